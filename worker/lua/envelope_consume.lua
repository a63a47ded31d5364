-- Take `units` of `kind` from the envelope: the check and the decrement are one step.
-- KEYS[1] envelope hash   KEYS[2] reservations zset   KEYS[3] receipt stream
-- KEYS[4] request-id key (optional; with it a repeated call gets the first answer again)
-- ARGV[1] envelope name  ARGV[2] host  ARGV[3] stream maxlen  ARGV[4] task id  ARGV[5] lease id
-- ARGV[6] kind: model | tool  ARGV[7] units (>= 1)  ARGV[8] '1' = dry run
-- ARGV[9] request-id ttl (s)  ARGV[10] request id
-- Returns {replayed, allowed, reason, remaining, consumed_model, consumed_tool, reserved_model,
--   reserved_tool, max_model, max_tool, budget, '', ''}, all strings; reason is one of
--   ok | unknown | empty | short | cap, or bad-kind | bad-units | corrupt (nothing changed).
-- A dry run only refunds reservations that had already expired, and stores no answer.
local kind, units, dry = ARGV[6], tonumber(ARGV[7]), ARGV[8] == '1'
if kind ~= 'model' and kind ~= 'tool' then return {'0', '0', 'bad-kind'} end
if not units or units < 1 or units > MAX_UNITS or units % 1 ~= 0 then
  return {'0', '0', 'bad-units'}
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
sweep(KEYS[1], KEYS[2], now_ms())
local why = refusal(KEYS[1], kind, units)
if dry then
  local out = answer(why and '0' or '1', why or 'ok', KEYS[1])
  table.insert(out, 1, '0')
  return out
end
if why then
  local rem = redis.call('HGET', KEYS[1], 'remaining')
  receipt(KEYS[3], ARGV[3], 'envelope_refused', ARGV[2], blank(ARGV[4]), blank(ARGV[5]),
    {envelope = ARGV[1], kind = kind, units = units, reason = why,
     remaining = tonumber(rem) or 0, request_id = blank(ARGV[10])})
else
  redis.call('HINCRBY', KEYS[1], 'remaining', -units)
  redis.call('HINCRBY', KEYS[1], 'consumed_' .. kind, units)
end
local out = answer(why and '0' or '1', why or 'ok', KEYS[1])
if rid then redis.call('SET', rid, cjson.encode(out), 'EX', ARGV[9]) end
table.insert(out, 1, '0')
return out
