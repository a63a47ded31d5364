-- Renew many running leases in one call, each exactly as lease_beat.lua renews one (no note):
-- its own checks, its own lapse min(now + gap, deadline); a refusal of one leaves the others.
-- KEYS[1] expiry index (zset)
-- KEYS[2i] lease i's hash   KEYS[2i+1] lease i's liveness key   (i = 1..n)
-- ARGV[i] lease i's token   (n = #ARGV)
-- Returns n replies in the order given, each {1, ms until the lease lapses} or {0, reason}:
--   unknown | stale-token | not-running:<status> | lapsed | deadline.
-- One TIME and one ZADD for the whole batch; an HMGET, a PEXPIRE and an HSET a lease.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local beat = string.format('%.6f', now)
local index = {}
local out = {}
for i = 1, #ARGV do
  local hash, alive = KEYS[2 * i], KEYS[2 * i + 1]
  local doc = redis.call('HMGET', hash, 'token', 'status', 'deadline_unix',
    'heartbeat_max_gap_sec', 'lease_id')
  local reply
  if not doc[1] then
    reply = {0, 'unknown'}
  elseif doc[1] ~= ARGV[i] then
    reply = {0, 'stale-token'}
  elseif doc[2] ~= 'running' then
    reply = {0, 'not-running:' .. doc[2]}
  elseif now >= tonumber(doc[3]) then
    if redis.call('EXISTS', alive) == 0 then reply = {0, 'lapsed'} else reply = {0, 'deadline'} end
  else
    local lapse = math.min(now + tonumber(doc[4]), tonumber(doc[3]))
    local ms = math.max(1, math.floor((lapse - now) * 1000))
    -- PEXPIRE on a missing key sets nothing and answers 0: a lapsed lease never comes back.
    if redis.call('PEXPIRE', alive, ms) == 0 then
      reply = {0, 'lapsed'}
    else
      index[#index + 1] = string.format('%.0f', lapse * 1000)
      index[#index + 1] = doc[5]
      redis.call('HSET', hash, 'heartbeat_unix', beat)
      reply = {1, ms}
    end
  end
  out[i] = reply
end
if #index > 0 then redis.call('ZADD', KEYS[1], unpack(index)) end
return out
