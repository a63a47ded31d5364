-- Read the envelope, after refunding reservations that expired uncommitted.
-- KEYS[1] envelope hash   KEYS[2] reservations zset
-- Returns '0|exists|ok|<state>||' with exists '1' or '0' (never reset), or '0|0|corrupt'.
local v = load(KEYS[1])
if not v then return '0|0|corrupt' end
v = sweep(KEYS[1], KEYS[2], v)
return '0|' .. reply(v[1] == '' and '0' or '1', 'ok', v)
