-- Create a batch of tasks at once, or none if any id names a task that may not be replaced.
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task index (zset)   KEYS[2] receipt stream   KEYS[3] queued index (zset)
-- KEYS[4] ended index (zset)
-- KEYS[3i+2], KEYS[3i+3], KEYS[3i+4] task hash, claim key, charged set of task i (i = 1..n)
-- ARGV[1] receipt stream maxlen   ARGV[2] seconds before recovery first checks a queued task
-- ARGV[5i-2..5i+2] of task i: id, spec JSON, run nonce, RQ queue, receipt body (task_submitted)
-- Returns {1, now} (Redis server time, submitted_unix) or {0, id} for the first id whose
-- record may not be replaced (a live task).
local n = (#KEYS - 4) / 3
for i = 1, n do
  local state = redis.call('HGET', KEYS[3 * i + 2], 'state')
  if state and not LEGAL.queued[state] then return {0, ARGV[5 * i - 2]} end
end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
local check = tonumber(now) + tonumber(ARGV[2])
for i = 1, n do
  local hash = KEYS[3 * i + 2]
  local a = 5 * i - 2
  redis.call('DEL', hash, KEYS[3 * i + 3], KEYS[3 * i + 4])
  redis.call('HSET', hash, 'id', ARGV[a], 'spec', ARGV[a + 1], 'run', ARGV[a + 2],
    'queue', ARGV[a + 3], 'state', 'queued', 'detail', '', 'attempt', '1', 'calls_used', '0',
    'checkpoint', '{}', 'submitted_unix', now, 'updated_unix', now)
  redis.call('ZADD', KEYS[1], tonumber(now) + (i - 1) / 1000000, ARGV[a])
  redis.call('ZADD', KEYS[3], check, ARGV[a])
  redis.call('ZREM', KEYS[4], ARGV[a])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'kind', 'task_submitted',
    'data', ARGV[a + 4])
end
return {1, now}
