-- Set the note of a running, live lease without renewing it.
-- KEYS[1] lease hash   KEYS[2] liveness key
-- ARGV[1] token  ARGV[2] note
-- Returns {1, 'ok'} or {0, reason}: unknown | stale-token | not-running:<status> | lapsed.
local doc = redis.call('HMGET', KEYS[1], 'token', 'status')
if not doc[1] then return {0, 'unknown'} end
if doc[1] ~= ARGV[1] then return {0, 'stale-token'} end
if doc[2] ~= 'running' then return {0, 'not-running:' .. doc[2]} end
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, 'lapsed'} end
redis.call('HSET', KEYS[1], 'note', ARGV[2])
return {1, 'ok'}
