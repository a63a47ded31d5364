-- `overnight reconcile --resume`: a paused task is queued again for a new attempt.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] receipt stream   KEYS[3] queued index (zset)
-- ARGV[1] attempt read with the checkpoint   ARGV[2] checkpoint JSON   ARGV[3] new attempt
-- ARGV[4] receipt stream maxlen   ARGV[5] receipt body (task_state)   ARGV[6] task id
-- ARGV[7] seconds before recovery checks the queued task
-- Returns {1} or {0, reason}: state:<state> | stale-attempt.
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not (doc[1] and LEGAL.queued[doc[1]]) then return {0, 'state:' .. tostring(doc[1])} end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'state', 'queued', 'detail', '', 'checkpoint', ARGV[2],
  'attempt', ARGV[3], 'updated_unix', now)
redis.call('ZADD', KEYS[3], tonumber(now) + tonumber(ARGV[7]), ARGV[6])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'task_state', 'data', ARGV[5])
return {1}
