-- Extend a task claim, only for the worker that holds it.
-- KEYS[1] claim key   ARGV[1] claim token   ARGV[2] claim TTL (ms)
-- Returns {1} or {0, 'lost'} if the claim is gone or someone else's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, 'lost'} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1}
