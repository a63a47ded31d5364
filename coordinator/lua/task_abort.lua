-- `overnight reconcile --abort`: a live task ends as aborted; a running holder loses its claim.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream
-- ARGV[1] detail   ARGV[2] receipt stream maxlen   ARGV[3] receipt body (task_state)
-- Returns {1} or {0, 'state:<state>'} if the task may not be aborted (it has ended).
local state = redis.call('HGET', KEYS[1], 'state')
if not (state and LEGAL.aborted[state]) then return {0, 'state:' .. tostring(state)} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'state', 'aborted', 'detail', ARGV[1], 'ended_unix', now,
  'updated_unix', now)
redis.call('DEL', KEYS[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'kind', 'task_state', 'data', ARGV[3])
return {1}
