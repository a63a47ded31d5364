-- Hold the worst case, `units` of `kind`, before a call whose cost is known only afterwards.
-- The units leave `remaining` now; envelope_commit gives back what was not spent, and a
-- reservation never committed is refunded by the first script that runs after it expires.
-- KEYS[1] envelope hash   KEYS[2] reservations zset   KEYS[3] receipt stream
-- KEYS[4] request-id key (optional; with it a repeated call gets the same reservation)
-- ARGV[1] envelope name  ARGV[2] host  ARGV[3] stream maxlen  ARGV[4] task id  ARGV[5] lease id
-- ARGV[6] kind: model | tool  ARGV[7] units (>= 1)  ARGV[8] reservation id
-- ARGV[9] reservation ttl (ms)  ARGV[10] request-id ttl (s)  ARGV[11] request id
-- Returns {replayed, allowed, reason, <8 state fields as in envelope_consume>, member,
--   expiry (server ms)}, all strings; reason as in envelope_consume.
local kind, units, ttl = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[9])
if kind ~= 'model' and kind ~= 'tool' then return {'0', '0', 'bad-kind'} end
if not units or units < 1 or units > MAX_UNITS or units % 1 ~= 0 then
  return {'0', '0', 'bad-units'}
end
if not ttl or ttl < 1 or not string.match(ARGV[8], '^[%w-]+$') then
  return {'0', '0', 'bad-reservation'}
end
if corrupt(KEYS[1]) then return {'0', '0', 'corrupt'} end
local rid = KEYS[4]
if rid then
  local first = redis.call('GET', rid)
  if first then
    local out = cjson.decode(first)
    table.insert(out, 1, '1')
    return out
  end
end
local now = now_ms()
sweep(KEYS[1], KEYS[2], now)
local why = refusal(KEYS[1], kind, units)
local member, expiry = '', ''
if why then
  local rem = redis.call('HGET', KEYS[1], 'remaining')
  receipt(KEYS[3], ARGV[3], 'envelope_refused', ARGV[2], blank(ARGV[4]), blank(ARGV[5]),
    {envelope = ARGV[1], kind = kind, units = units, reason = why, reserve = true,
     remaining = tonumber(rem) or 0, request_id = blank(ARGV[11])})
else
  member = ARGV[8] .. '|' .. kind .. '|' .. string.format('%.0f', units)
  expiry = string.format('%.0f', now + ttl)
  redis.call('HINCRBY', KEYS[1], 'remaining', -units)
  redis.call('HINCRBY', KEYS[1], 'reserved_' .. kind, units)
  redis.call('ZADD', KEYS[2], expiry, member)
end
local out = answer(why and '0' or '1', why or 'ok', KEYS[1], member, expiry)
if rid then redis.call('SET', rid, cjson.encode(out), 'EX', ARGV[10]) end
table.insert(out, 1, '0')
return out
