-- A worker takes a queued task for one attempt; the claim key lapses if the worker dies.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream
-- KEYS[4] claim index (zset)   KEYS[5] queued index (zset)
-- ARGV[1] attempt   ARGV[2] claim token   ARGV[3] claim TTL (ms)   ARGV[4] runner JSON
-- ARGV[5] receipt stream maxlen   ARGV[6] receipt body (task_state)   ARGV[7] task id
-- Times are Redis server time: started_unix is set by the first claim.
-- Returns {1} or {0, reason}: unknown | stale-attempt | state:<state> | claimed.
local doc = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if not doc[1] then return {0, 'unknown'} end
if doc[2] ~= ARGV[1] then return {0, 'stale-attempt'} end
if not LEGAL.running[doc[1]] then return {0, 'state:' .. doc[1]} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 'claimed'} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[4], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  + tonumber(ARGV[3]), ARGV[7])
redis.call('ZREM', KEYS[5], ARGV[7])
redis.call('HSET', KEYS[1], 'state', 'running', 'detail', '', 'runner', ARGV[4],
  'updated_unix', now)
redis.call('HSETNX', KEYS[1], 'started_unix', now)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'kind', 'task_state', 'data', ARGV[6])
return {1}
