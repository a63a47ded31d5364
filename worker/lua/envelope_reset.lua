-- Start the envelope over: remaining = budget = n, consumed and reserved back to 0, caps set
-- (or cleared), open reservations dropped so a late commit cannot refund into the new budget.
-- A corrupt record is replaced.
-- KEYS[1] envelope hash   KEYS[2] reservations zset   KEYS[3] receipt stream
-- ARGV[1] receipt context (JSON)  ARGV[2] n (>= 0)  ARGV[3] max_model ('' = no cap)
-- ARGV[4] max_tool ('' = no cap)  ARGV[5] '1' = only if the envelope does not exist yet
-- ARGV[6] max_tokens (absent or '' = no token cap)
-- Returns JSON {allowed = true, reason = 'ok', state}, or {allowed = false, reason} with
--   reason bad-units | exists (nothing changed).
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then return refused('exists') end
local n = tonumber(ARGV[2])
if bad_units(n, 0) then return refused('bad-units') end
local max_tokens = ARGV[6] or ''
for _, cap in ipairs({ARGV[3], ARGV[4], max_tokens}) do
  if cap ~= '' and bad_units(tonumber(cap), 0) then return refused('bad-units') end
end
-- A reset repairs a corrupt record: its old values are not read, only replaced.
local before = load(KEYS[1]) or {}
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'remaining', fmt(n), 'budget', fmt(n), 'consumed_model', 0,
  'consumed_tool', 0, 'reserved_model', 0, 'reserved_tool', 0, 'consumed_tokens', 0,
  'reserved_tokens', 0)
if max_tokens ~= '' then redis.call('HSET', KEYS[1], 'max_tokens', fmt(tonumber(max_tokens))) end
for i, field in ipairs({'max_model', 'max_tool'}) do
  local cap = ARGV[2 + i]
  if cap ~= '' then redis.call('HSET', KEYS[1], field, fmt(tonumber(cap))) end
end
receipt(KEYS[3], ARGV[1], 'envelope_reset', {budget = n,
  max_model = tonumber(ARGV[3]), max_tool = tonumber(ARGV[4]), max_tokens = tonumber(max_tokens),
  previous_remaining = tonumber(before[1]), previous_consumed_model = tonumber(before[2]),
  previous_consumed_tool = tonumber(before[3])})
return reply(true, 'ok', load(KEYS[1]))
