-- Drop a lease from the expiry index when it no longer names a running lease (its document
-- expired or was ended without the index noticing), so stale entries do not cost every pass.
-- KEYS[1] lease hash   KEYS[2] expiry index (zset)
-- ARGV[1] lease_id
-- Returns {1, 'pruned'} or {0, 'running'} (a running lease is never dropped here).
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'running' then return {0, 'running'} end
redis.call('ZREM', KEYS[2], ARGV[1])
return {1, 'pruned'}
