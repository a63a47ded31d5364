-- Hold the worst case, `units` of `kind`, before a call whose cost is known only afterwards.
-- The units leave `remaining` now; envelope_commit gives back what was not spent, and a
-- reservation never committed is refunded by the first script that runs after it expires.
-- KEYS[1] envelope hash   KEYS[2] reservations zset   KEYS[3] receipt stream
-- KEYS[4] request-id key (optional; with it a repeated call gets the same reservation)
-- ARGV[1] receipt context (JSON)  ARGV[2] kind: model | tool  ARGV[3] units (>= 1)
-- ARGV[4] reservation id  ARGV[5] reservation ttl (ms)  ARGV[6] request-id ttl (s)
-- ARGV[7] request id
-- Returns JSON {allowed, reason, state, member, expires_ms, replayed (only when true)};
--   member and expires_ms only when allowed; reason as in envelope_consume, or
--   bad-reservation.
local kind, units, ttl, rid = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5]), KEYS[4]
if not AT[kind] then return refused('bad-kind') end
if bad_units(units, 1) then return refused('bad-units') end
if bad_units(ttl, 1) or not string.match(ARGV[4], '^[%w-]+$') then
  return refused('bad-reservation')
end
if rid then
  local first = redis.call('GET', rid)
  if first then return replayed(first) end
end
local now = now_ms()
local v = load(KEYS[1])
if not v then return refused('corrupt') end
v = sweep(KEYS[1], KEYS[2], v, now)
local why = refusal(v, kind, units)
local member, expiry
if why then
  receipt(KEYS[3], ARGV[1], 'envelope_refused', {kind = kind, units = units,
    reason = why, reserve = true, remaining = tonumber(v[1]) or 0,
    request_id = rid and ARGV[7] or nil})
else
  local at = AT[kind]
  member = ARGV[4] .. ':' .. kind .. ':' .. fmt(units)
  expiry = fmt(now + ttl)
  v[1] = fmt(tonumber(v[1]) - units)
  v[at[2]] = fmt((tonumber(v[at[2]]) or 0) + units)
  redis.call('HSET', KEYS[1], 'remaining', v[1], FIELDS[at[2]], v[at[2]])
  redis.call('ZADD', KEYS[2], expiry, member)
end
local out = reply(not why, why or 'ok', v, member, expiry)
if rid then redis.call('SET', rid, out, 'EX', ARGV[6]) end
return out
