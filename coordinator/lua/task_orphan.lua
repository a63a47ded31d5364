-- Recovery: a running task whose claim lapsed (its worker died) is re-queued, paused or expired.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream   KEYS[4] claim index (zset)
-- KEYS[5] queued index (zset)   KEYS[6] ended index (zset)   KEYS[7] charged set
-- ARGV[1] attempt read with the checkpoint   ARGV[2] target state
-- ARGV[3] checkpoint JSON   ARGV[4] detail   ARGV[5] new attempt
-- ARGV[6] receipt stream maxlen   ARGV[7] receipt body (task_state)   ARGV[8] task id
-- ARGV[9] seconds before recovery checks a re-queued task   ARGV[10] retention (s)
-- Returns {1} or {0, reason}: illegal:<target> | alive | state:<state> | stale-attempt.
-- A task no longer running leaves the claim index (its entry there was stale).
local from = LEGAL[ARGV[2]]
if not from then return {0, 'illegal:' .. ARGV[2]} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 'alive'} end
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not (doc[1] and from[doc[1]]) then
  redis.call('ZREM', KEYS[4], ARGV[8])
  return {0, 'state:' .. tostring(doc[1])}
end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'checkpoint', ARGV[3], 'detail', ARGV[4],
  'attempt', ARGV[5], 'updated_unix', now)
redis.call('ZREM', KEYS[4], ARGV[8])
if ARGV[2] == 'queued' then redis.call('ZADD', KEYS[5], tonumber(now) + tonumber(ARGV[9]), ARGV[8]) end
if TERMINAL[ARGV[2]] then
  redis.call('HSET', KEYS[1], 'ended_unix', now)
  redis.call('ZADD', KEYS[6], now, ARGV[8])
  redis.call('EXPIRE', KEYS[1], ARGV[10])
  redis.call('EXPIRE', KEYS[7], ARGV[10])
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'kind', 'task_state', 'data', ARGV[7])
return {1}
