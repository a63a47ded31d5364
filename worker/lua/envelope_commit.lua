-- Settle an open reservation: charge `actual` (0..units) and give back the rest, once.
-- KEYS[1] envelope hash   KEYS[2] reservations zset
-- ARGV[1] reservation member 'id|kind|units'  ARGV[2] actual units spent
-- Returns {'0', allowed, reason, <8 state fields as in envelope_consume>, '', ''}, all strings;
--   reason is ok | unknown (expired and refunded, already settled, or the envelope was reset)
--   | bad-actual | corrupt (nothing changed).
local member, actual = ARGV[1], tonumber(ARGV[2])
local _, kind, units = string.match(member, '^(.-)|(%a+)|(%d+)$')
if not kind then return {'0', '0', 'unknown'} end
units = tonumber(units)
if not actual or actual < 0 or actual > units or actual % 1 ~= 0 then
  return {'0', '0', 'bad-actual'}
end
if corrupt(KEYS[1]) then return {'0', '0', 'corrupt'} end
sweep(KEYS[1], KEYS[2], now_ms())
if not redis.call('ZSCORE', KEYS[2], member) or redis.call('EXISTS', KEYS[1]) == 0 then
  local out = answer('0', 'unknown', KEYS[1])
  table.insert(out, 1, '0')
  return out
end
redis.call('ZREM', KEYS[2], member)
redis.call('HINCRBY', KEYS[1], 'reserved_' .. kind, -units)
redis.call('HINCRBY', KEYS[1], 'consumed_' .. kind, actual)
redis.call('HINCRBY', KEYS[1], 'remaining', units - actual)
local out = answer('1', 'ok', KEYS[1])
table.insert(out, 1, '0')
return out
