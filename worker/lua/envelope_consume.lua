-- Take `units` of `kind` from the envelope: the check and the decrement are one step.
-- KEYS[1] envelope hash   KEYS[2] reservations zset   KEYS[3] receipt stream
-- KEYS[4] request-id key (optional; with it a repeated call gets the first answer again)
-- ARGV[1] receipt context (JSON)  ARGV[2] kind: model | tool  ARGV[3] units (>= 1)
-- ARGV[4] '1' = dry run  ARGV[5] request-id ttl (s), ARGV[6] request id (both only with KEYS[4])
-- Returns JSON {allowed, reason, state, replayed (only when true)} (see envelope_lib);
--   reason is ok | unknown | empty | short | cap, or bad-kind | bad-units | corrupt (no
--   state) with nothing changed.
-- A dry run stores no answer and changes nothing but the refund of expired reservations.
local kind, units, dry, rid = ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1', KEYS[4]
if not AT[kind] then return refused('bad-kind') end
if bad_units(units, 1) then return refused('bad-units') end
if rid then
  local first = redis.call('GET', rid)
  if first then return replayed(first) end
end
local v = load(KEYS[1])
if not v then return refused('corrupt') end
v = sweep(KEYS[1], KEYS[2], v)
local why = refusal(v, kind, units)
if dry then return reply(not why, why or 'ok', v) end
if why then
  receipt(KEYS[3], ARGV[1], 'envelope_refused', {kind = kind, units = units,
    reason = why, remaining = tonumber(v[1]) or 0, request_id = rid and ARGV[6] or nil})
else
  -- One write of values computed from the state just read: exact, and the script is atomic.
  local at = AT[kind]
  v[1] = fmt(tonumber(v[1]) - units)
  v[at[1]] = fmt((tonumber(v[at[1]]) or 0) + units)
  redis.call('HSET', KEYS[1], 'remaining', v[1], FIELDS[at[1]], v[at[1]])
end
local out = reply(not why, why or 'ok', v)
if rid then redis.call('SET', rid, out, 'EX', ARGV[5]) end
return out
