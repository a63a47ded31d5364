-- Start a new lease: write the document, the liveness key and the expiry index.
-- KEYS[1] lease hash   KEYS[2] liveness key   KEYS[3] fencing sequence
-- KEYS[4] expiry index (zset)   KEYS[5] all-leases index (zset)   KEYS[6] receipt stream
-- ARGV[1] lease_id  ARGV[2] host  ARGV[3] supervisor_pid  ARGV[4] budget_sec  ARGV[5] gap_sec
-- ARGV[6] note  ARGV[7] boot_id  ARGV[8] task_id ('' = none)  ARGV[9] receipt stream maxlen
-- ARGV[10] index retention (seconds; ended leases older than this leave the listing)
-- ARGV[11] SHA-1 of the supervisor's end key ('' = none): only its holder may end the lease
--   while it is live, so a child handed just the token cannot write itself a verdict.
-- Returns {1, token, started_unix, deadline_unix} or {0, reason}: exists | bad-args.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, 'exists'}
end
local budget = tonumber(ARGV[4])
local gap = tonumber(ARGV[5])
if not budget or not gap or budget <= 0 or gap <= 0 then
  return {0, 'bad-args'}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local deadline = now + budget
local lapse = math.min(now + gap, deadline)

-- The token is at least the server's clock in microseconds, so it keeps growing even if a
-- Redis without persistence restarts and forgets the sequence: no acquire runs in under a
-- microsecond, so tokens never run ahead of that clock (in milliseconds a burst of acquires
-- did, and a quick restart then handed out a token again). Exact in doubles until 2255.
local last = tonumber(redis.call('GET', KEYS[3]) or '0')
local token = math.max(last + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
local token_s = string.format('%.0f', token)
redis.call('SET', KEYS[3], token_s)

local fmt = function(x) return string.format('%.6f', x) end
redis.call('HSET', KEYS[1],
  'lease_id', ARGV[1], 'token', token_s, 'holder_pid', '0', 'pgid', '0', 'host', ARGV[2],
  'budget_sec', ARGV[4], 'started_unix', fmt(now), 'deadline_unix', fmt(deadline),
  'heartbeat_unix', fmt(now), 'heartbeat_max_gap_sec', ARGV[5], 'status', 'running',
  'note', ARGV[6], 'exit_code', '', 'ended_unix', '', 'supervisor_pid', ARGV[3],
  'child_start_ticks', '', 'boot_id', ARGV[7], 'task_id', ARGV[8], 'end_key_sha1', ARGV[11] or '')
redis.call('SET', KEYS[2], token_s, 'PX', math.max(1, math.floor((lapse - now) * 1000)))
redis.call('ZADD', KEYS[4], string.format('%.0f', lapse * 1000), ARGV[1])
-- Microseconds in the score too, so leases started within one millisecond still list in order.
redis.call('ZADD', KEYS[5], string.format('%.3f', now * 1000), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf',
  string.format('%.0f', (now - tonumber(ARGV[10])) * 1000))
local receipt = cjson.encode({ts = now, host = ARGV[2], lease_id = ARGV[1],
  task_id = (ARGV[8] ~= '' and ARGV[8]) or nil,
  data = {token = 0, budget_sec = budget, heartbeat_max_gap_sec = gap}})
-- cjson writes numbers with 14 significant digits and a token has 16: splice in its digits.
receipt = string.gsub(receipt, '"token":0([,}])', '"token":' .. token_s .. '%1', 1)
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[9], '*', 'kind', 'lease_acquired', 'data', receipt)
return {1, token_s, fmt(now), fmt(deadline)}
