-- The slower lease beat, kept for bench.hosts's before/after comparison only: six calls a
-- beat, where worker/lua/lease_beat.lua makes five (it takes the EXISTS from the PEXPIRE's
-- answer).
-- Renew a running lease: push its lapse to min(now + gap, deadline), optionally set the note.
-- KEYS[1] lease hash   KEYS[2] liveness key   KEYS[3] expiry index (zset)
-- ARGV[1] token  ARGV[2] '1' to set the note, else '0'  ARGV[3] note
-- Returns {1, ms until the lease lapses} or {0, reason}:
--   unknown | stale-token | not-running:<status> | lapsed | deadline.
local doc = redis.call('HMGET', KEYS[1], 'token', 'status', 'deadline_unix',
  'heartbeat_max_gap_sec', 'lease_id')
if not doc[1] then return {0, 'unknown'} end
if doc[1] ~= ARGV[1] then return {0, 'stale-token'} end
if doc[2] ~= 'running' then return {0, 'not-running:' .. doc[2]} end
-- A lapsed lease never comes back, even if its supervisor has not noticed yet.
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, 'lapsed'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local deadline = tonumber(doc[3])
if now >= deadline then return {0, 'deadline'} end
local lapse = math.min(now + tonumber(doc[4]), deadline)
local ms = math.max(1, math.floor((lapse - now) * 1000))
redis.call('PEXPIRE', KEYS[2], ms)
redis.call('ZADD', KEYS[3], string.format('%.0f', lapse * 1000), doc[5])
redis.call('HSET', KEYS[1], 'heartbeat_unix', string.format('%.6f', now))
if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 'note', ARGV[3]) end
return {1, ms}
