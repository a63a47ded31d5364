-- Start the envelope over: remaining = budget = n, consumed and reserved back to 0, caps set
-- (or cleared), open reservations dropped so a late commit cannot refund into the new budget.
-- KEYS[1] envelope hash   KEYS[2] reservations zset   KEYS[3] receipt stream
-- ARGV[1] envelope name  ARGV[2] host  ARGV[3] stream maxlen  ARGV[4] task id  ARGV[5] lease id
-- ARGV[6] n (>= 0)  ARGV[7] max_model ('' = no cap)  ARGV[8] max_tool ('' = no cap)
-- Returns {'0', '1', 'ok', <8 state fields as in envelope_consume>, '', ''} or
--   {'0', '0', 'bad-units'} (nothing changed).
local n = tonumber(ARGV[6])
if not n or n < 0 or n > MAX_UNITS or n % 1 ~= 0 then return {'0', '0', 'bad-units'} end
for i = 7, 8 do
  local cap = tonumber(ARGV[i])
  if ARGV[i] ~= '' and (not cap or cap < 0 or cap > MAX_UNITS or cap % 1 ~= 0) then
    return {'0', '0', 'bad-units'}
  end
end
-- A reset repairs a corrupt envelope: the old values are not read, only replaced.
local before = corrupt(KEYS[1]) and {} or state(KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
local ns = string.format('%.0f', n)
redis.call('HSET', KEYS[1], 'remaining', ns, 'budget', ns, 'consumed_model', 0,
  'consumed_tool', 0, 'reserved_model', 0, 'reserved_tool', 0)
for i, field in ipairs({'max_model', 'max_tool'}) do
  local cap = ARGV[6 + i]
  if cap ~= '' then redis.call('HSET', KEYS[1], field, string.format('%.0f', tonumber(cap))) end
end
receipt(KEYS[3], ARGV[3], 'envelope_reset', ARGV[2], blank(ARGV[4]), blank(ARGV[5]),
  {envelope = ARGV[1], budget = n, max_model = tonumber(ARGV[7]), max_tool = tonumber(ARGV[8]),
   previous_remaining = tonumber(before[1]), previous_consumed_model = tonumber(before[2]),
   previous_consumed_tool = tonumber(before[3])})
local out = answer('1', 'ok', KEYS[1])
table.insert(out, 1, '0')
return out
