-- The reaper ends a running lease whose liveness key has lapsed, once: the first writer wins,
-- so a slow supervisor and a reaper (or two reapers) never both end it. It never writes 'done'.
-- KEYS[1] lease hash   KEYS[2] liveness key   KEYS[3] expiry index (zset)   KEYS[4] receipt stream
-- ARGV[1] token  ARGV[2] status: killed | expired  ARGV[3] note  ARGV[4] receipt kind
-- ARGV[5] receipt stream maxlen  ARGV[6] seconds to keep the ended document
-- ARGV[7] host of the writer
-- Returns {1, ended_unix} or
--   {0, reason}: unknown | stale-token | already-ended:<status> | alive | bad-status.
local doc = redis.call('HMGET', KEYS[1], 'token', 'status', 'lease_id', 'task_id')
if not doc[1] then return {0, 'unknown'} end
if doc[1] ~= ARGV[1] then return {0, 'stale-token'} end
if doc[2] ~= 'running' then return {0, 'already-ended:' .. doc[2]} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 'alive'} end
local status = ARGV[2]
if status ~= 'killed' and status ~= 'expired' then return {0, 'bad-status'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ended = string.format('%.6f', now)
redis.call('HSET', KEYS[1], 'status', status, 'note', ARGV[3], 'exit_code', '',
  'ended_unix', ended)
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZREM', KEYS[3], doc[3])
local receipt = cjson.encode({ts = now, host = ARGV[7], lease_id = doc[3],
  task_id = (doc[4] ~= '' and doc[4]) or nil,
  data = {status = status, note = ARGV[3], writer = 'reaper', token = 0}})
-- cjson writes numbers with 14 significant digits and a token has 16: splice in its digits.
receipt = string.gsub(receipt, '"token":0([,}])', '"token":' .. ARGV[1] .. '%1', 1)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'kind', ARGV[4], 'data', receipt)
return {1, ended}
