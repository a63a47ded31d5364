-- `overnight reconcile --abort`: a live task ends as aborted; a running holder loses its claim.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream
-- ARGV[1] detail   ARGV[2] now   ARGV[3] receipt stream maxlen   ARGV[4] receipt body
-- Returns {1} or {0, 'state:<state>'} if the task may not be aborted (it has ended).
local state = redis.call('HGET', KEYS[1], 'state')
if not (state and LEGAL.aborted[state]) then return {0, 'state:' .. tostring(state)} end
redis.call('HSET', KEYS[1], 'state', 'aborted', 'detail', ARGV[1], 'ended_unix', ARGV[2],
  'updated_unix', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'task_state', 'data', ARGV[4])
return {1}
