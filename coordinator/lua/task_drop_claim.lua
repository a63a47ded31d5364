-- A worker whose work horse died drops that horse's claim at once, so recovery need not
-- wait for the claim to lapse. Only the claim of the named attempt and runner pid is dropped.
-- KEYS[1] task hash   KEYS[2] claim key
-- ARGV[1] attempt   ARGV[2] runner pid (the dead horse)
-- Returns 1 if dropped, 0 otherwise.
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'runner')
if doc[1] ~= 'running' or doc[2] ~= ARGV[1] or not doc[3] then return 0 end
local ok, runner = pcall(cjson.decode, doc[3])
if not ok or type(runner) ~= 'table' or tostring(runner.pid) ~= ARGV[2] then return 0 end
return redis.call('DEL', KEYS[2])
