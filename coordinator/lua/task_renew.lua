-- Extend a task claim, only for the worker that holds it (and its entry in the claim index).
-- KEYS[1] claim key   KEYS[2] claim index (zset)
-- ARGV[1] claim token   ARGV[2] claim TTL (ms)   ARGV[3] task id
-- Returns {1} or {0, 'lost'} if the claim is gone or someone else's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, 'lost'} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  + tonumber(ARGV[2]), ARGV[3])
return {1}
