-- Settle an open reservation: charge `actual` (0..units) and give back the rest, once.
-- KEYS[1] envelope hash   KEYS[2] reservations zset
-- ARGV[1] reservation member 'id:kind:units'  ARGV[2] actual units spent
-- Returns JSON {allowed, reason, state}; reason is ok | unknown (expired and refunded,
--   already settled, or the envelope was reset since) | bad-actual | corrupt (no state;
--   nothing changed).
local member, actual = ARGV[1], tonumber(ARGV[2])
local _, kind, units = string.match(member, '^(.-):(%a+):(%d+)$')
if not AT[kind] then return refused('unknown') end
units = tonumber(units)
if bad_units(actual, 0) or actual > units then return refused('bad-actual') end
local v = load(KEYS[1])
if not v then return refused('corrupt') end
v = sweep(KEYS[1], KEYS[2], v)
if v[1] == '' or not redis.call('ZSCORE', KEYS[2], member) then
  return reply(false, 'unknown', v)
end
redis.call('ZREM', KEYS[2], member)
local at = AT[kind]
v[at[2]] = fmt((tonumber(v[at[2]]) or 0) - units)
v[at[1]] = fmt((tonumber(v[at[1]]) or 0) + actual)
v[1] = fmt(tonumber(v[1]) + units - actual)
redis.call('HSET', KEYS[1], FIELDS[at[2]], v[at[2]], FIELDS[at[1]], v[at[1]],
  'remaining', v[1])
return reply(true, 'ok', v)
