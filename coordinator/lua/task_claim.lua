-- A worker takes a queued task for one attempt; the claim key lapses if the worker dies.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream
-- ARGV[1] attempt   ARGV[2] claim token   ARGV[3] claim TTL (ms)   ARGV[4] now
-- ARGV[5] runner JSON   ARGV[6] receipt stream maxlen   ARGV[7] receipt body (task_state)
-- Returns {1} or {0, reason}: unknown | stale-attempt | state:<state> | claimed.
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not doc[1] then return {0, 'unknown'} end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
if not LEGAL.running[doc[1]] then return {0, 'state:' .. doc[1]} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 'claimed'} end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'state', 'running', 'detail', '', 'runner', ARGV[5],
  'updated_unix', ARGV[4])
redis.call('HSETNX', KEYS[1], 'started_unix', ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'kind', 'task_state', 'data', ARGV[7])
return {1}
