-- `overnight rerun`: an ended task is queued again, its record kept (calls_used, receipts),
-- with a new spec (its max_calls), checkpoint and run nonce; its deadline starts again.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] receipt stream   KEYS[3] queued index (zset)
-- KEYS[4] ended index (zset)   KEYS[5] charged request ids (set)   KEYS[6] claim key
-- ARGV[1] attempt read with the record   ARGV[2] checkpoint JSON   ARGV[3] new attempt
-- ARGV[4] spec JSON   ARGV[5] run nonce   ARGV[6] receipt stream maxlen
-- ARGV[7] receipt body (task_state)   ARGV[8] task id
-- ARGV[9] seconds before recovery checks the queued task
-- Returns {1} or {0, reason}: state:<state> (it has not ended) | stale-attempt.
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not (doc[1] and LEGAL.queued[doc[1]]) then return {0, 'state:' .. tostring(doc[1])} end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'state', 'queued', 'detail', '', 'checkpoint', ARGV[2],
  'attempt', ARGV[3], 'spec', ARGV[4], 'run', ARGV[5], 'updated_unix', now)
redis.call('HDEL', KEYS[1], 'started_unix', 'ended_unix', 'runner')
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[5])
redis.call('DEL', KEYS[6])
redis.call('ZREM', KEYS[4], ARGV[8])
redis.call('ZADD', KEYS[3], tonumber(now) + tonumber(ARGV[9]), ARGV[8])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'kind', 'task_state', 'data', ARGV[7])
return {1}
