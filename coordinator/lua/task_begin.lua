-- The claim holder begins a step: it charges the step's call to the task's own max_calls
-- (once per request id, so a step run again is not charged again) and checkpoints the step
-- as in flight, in one write.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] charged request ids (set)
-- ARGV[1] claim token   ARGV[2] request id   ARGV[3] max_calls   ARGV[4] checkpoint JSON
-- Returns {1, calls_used, now} (now: Redis server time, as written) or {0, reason}: lost (the
-- claim is gone or not ours) |
-- state:<state> | ceiling (max_calls reached; nothing is written).
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0, 'lost'} end
local state = redis.call('HGET', KEYS[1], 'state')
if not (state and LEGAL.running[state]) then return {0, 'state:' .. tostring(state)} end
local used = tonumber(redis.call('HGET', KEYS[1], 'calls_used') or '0')
if redis.call('SISMEMBER', KEYS[3], ARGV[2]) == 0 then
  if used >= tonumber(ARGV[3]) then return {0, 'ceiling'} end
  redis.call('SADD', KEYS[3], ARGV[2])
  used = redis.call('HINCRBY', KEYS[1], 'calls_used', 1)
end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[4], 'updated_unix', now)
return {1, used, now}
