-- `overnight reconcile --resume`: a paused task is queued again for a new attempt.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] receipt stream
-- ARGV[1] attempt read with the checkpoint   ARGV[2] checkpoint JSON   ARGV[3] new attempt
-- ARGV[4] now   ARGV[5] receipt stream maxlen   ARGV[6] receipt body (task_state)
-- Returns {1} or {0, reason}: state:<state> | stale-attempt.
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not (doc[1] and LEGAL.queued[doc[1]]) then return {0, 'state:' .. tostring(doc[1])} end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
redis.call('HSET', KEYS[1], 'state', 'queued', 'detail', '', 'checkpoint', ARGV[2],
  'attempt', ARGV[3], 'updated_unix', ARGV[4])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'kind', 'task_state', 'data', ARGV[6])
return {1}
