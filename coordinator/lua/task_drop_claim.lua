-- A worker whose work horse died drops that horse's claim at once, so recovery need not
-- wait for the claim to lapse. Only the claim of the named attempt and runner pid is dropped.
-- LEGAL, TERMINAL: compiled in above (empty LEGAL: this script changes no state).
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] claim index (zset)
-- ARGV[1] attempt   ARGV[2] runner pid (the dead horse)   ARGV[3] the state a claim is held in
-- ARGV[4] task id
-- Returns {1} or {0, reason}: state:<state> | stale-attempt | not-runner | lost (no claim).
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'runner')
if doc[1] ~= ARGV[3] then return {0, 'state:' .. tostring(doc[1])} end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
local ok, runner = pcall(cjson.decode, doc[3] or '')
if not ok or type(runner) ~= 'table' or tostring(runner.pid) ~= ARGV[2] then
  return {0, 'not-runner'}
end
if redis.call('DEL', KEYS[2]) == 0 then return {0, 'lost'} end
redis.call('ZADD', KEYS[3], 0, ARGV[4])
return {1}
