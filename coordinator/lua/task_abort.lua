-- `overnight reconcile --abort`: a live task ends as aborted; a running holder loses its claim.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream   KEYS[4] claim index (zset)
-- KEYS[5] queued index (zset)   KEYS[6] ended index (zset)   KEYS[7] charged set
-- ARGV[1] detail   ARGV[2] receipt stream maxlen   ARGV[3] receipt body (task_state)
-- ARGV[4] task id   ARGV[5] retention (s)
-- Returns {1} or {0, 'state:<state>'} if the task may not be aborted (it has ended).
local state = redis.call('HGET', KEYS[1], 'state')
if not (state and LEGAL.aborted[state]) then return {0, 'state:' .. tostring(state)} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'state', 'aborted', 'detail', ARGV[1], 'ended_unix', now,
  'updated_unix', now)
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[4])
redis.call('ZREM', KEYS[5], ARGV[4])
redis.call('ZADD', KEYS[6], now, ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[7], ARGV[5])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'kind', 'task_state', 'data', ARGV[3])
return {1}
