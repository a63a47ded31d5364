-- Give back a call charged for a request the shared envelope then refused (or could not be
-- asked about), or for a step that never started. Run twice, it gives back once.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] charged request ids (set)
-- ARGV[1] claim token   ARGV[2] request id
-- Returns {1, calls_used} once the request holds no charge of the task (given back now or
-- before), or {0, 'lost'} if the claim is gone or not ours (the charge stays).
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0, 'lost'} end
if redis.call('SREM', KEYS[3], ARGV[2]) == 1 then
  return {1, redis.call('HINCRBY', KEYS[1], 'calls_used', -1)}
end
return {1, tonumber(redis.call('HGET', KEYS[1], 'calls_used') or '0')}
