-- The gateway saw a model at work for a lease: record it on the grant in server ms, so the
-- lease's keeper counts it as progress (the step cannot write this: it has no Redis).
-- KEYS[1] grant hash
-- ARGV: none
-- Returns {1}, or {0, 'ended'} if the grant is gone (the lease ended).
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 'ended'} end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'progress_ms',
  string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
return {1}
