-- Read the envelope, after refunding reservations that expired uncommitted.
-- KEYS[1] envelope hash   KEYS[2] reservations zset
-- Returns {'0', exists ('1' or '0'), 'ok', <8 state fields as in envelope_consume>, '', ''}.
if corrupt(KEYS[1]) then return {'0', '0', 'corrupt'} end
sweep(KEYS[1], KEYS[2], now_ms())
local out = answer(tostring(redis.call('EXISTS', KEYS[1])), 'ok', KEYS[1])
table.insert(out, 1, '0')
return out
