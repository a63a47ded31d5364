-- Read the envelope, after refunding reservations that expired uncommitted.
-- KEYS[1] envelope hash   KEYS[2] reservations zset
-- ARGV: none
-- Returns JSON {allowed, reason = 'ok', state}: allowed is whether the envelope exists (it was
--   reset once); or {allowed = false, reason = 'corrupt'}.
local v = load(KEYS[1])
if not v then return refused('corrupt') end
v = sweep(KEYS[1], KEYS[2], v)
return reply(v[1] ~= '', 'ok', v)
