-- The holder ends its running lease with a terminal status, once: the first writer wins.
-- Only the supervisor that acquired the lease holds its end key, so a child handed just the
-- token cannot write itself a verdict. The check needs redis.sha1hex (every Redis has it;
-- fakeredis's Lua does not, and there this script fails rather than skip the check).
-- KEYS[1] lease hash   KEYS[2] liveness key   KEYS[3] expiry index (zset)   KEYS[4] receipt stream
-- ARGV[1] token  ARGV[2] status: done | killed | expired  ARGV[3] note
-- ARGV[4] exit code ('' = none)  ARGV[5] receipt kind  ARGV[6] receipt stream maxlen
-- ARGV[7] seconds to keep the ended document  ARGV[8] host of the writer
-- ARGV[9] '1' = also return the ended document (saves the writer a read)
-- ARGV[10] the end key whose SHA-1 acquire stored
-- Returns {1, ended_unix} (with ARGV[9]: {1, ended_unix, HGETALL of the document}) or
--   {0, reason}: unknown | stale-token | already-ended:<status> | bad-status | end-key.
local status = ARGV[2]
if status ~= 'done' and status ~= 'killed' and status ~= 'expired' then
  return {0, 'bad-status'}
end
local doc = redis.call('HMGET', KEYS[1], 'token', 'status', 'lease_id', 'task_id',
  'end_key_sha1')
if not doc[1] then return {0, 'unknown'} end
if doc[1] ~= ARGV[1] then return {0, 'stale-token'} end
if doc[2] ~= 'running' then return {0, 'already-ended:' .. doc[2]} end
if not redis.sha1hex then
  return redis.error_reply('lease_end: this server has no redis.sha1hex')
end
if not doc[5] or doc[5] == '' or redis.sha1hex(ARGV[10]) ~= doc[5] then
  return {0, 'end-key'}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ended = string.format('%.6f', now)
redis.call('HSET', KEYS[1], 'status', status, 'note', ARGV[3], 'exit_code', ARGV[4],
  'ended_unix', ended)
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], doc[3])
local receipt = cjson.encode({ts = now, host = ARGV[8], lease_id = doc[3],
  task_id = (doc[4] ~= '' and doc[4]) or nil,
  data = {status = status, note = ARGV[3], exit_code = tonumber(ARGV[4]), writer = 'supervisor',
          token = 0}})
-- cjson writes numbers with 14 significant digits and a token has 16: splice in its digits.
receipt = string.gsub(receipt, '"token":0([,}])', '"token":' .. ARGV[1] .. '%1', 1)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'kind', ARGV[5], 'data', receipt)
if ARGV[9] == '1' then return {1, ended, redis.call('HGETALL', KEYS[1])} end
return {1, ended}
