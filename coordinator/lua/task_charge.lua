-- Charge one call to the task's own max_calls, once per request id.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] charged request ids (set)
-- ARGV[1] claim token   ARGV[2] request id   ARGV[3] max_calls
-- Returns {1, calls_used} if charged (or charged before), or {0, reason}: lost (the claim is
-- gone or not ours) | ceiling (max_calls reached).
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0, 'lost'} end
local used = tonumber(redis.call('HGET', KEYS[1], 'calls_used') or '0')
if redis.call('SISMEMBER', KEYS[3], ARGV[2]) == 1 then return {1, used} end
if used >= tonumber(ARGV[3]) then return {0, 'ceiling'} end
redis.call('SADD', KEYS[3], ARGV[2])
return {1, redis.call('HINCRBY', KEYS[1], 'calls_used', 1)}
