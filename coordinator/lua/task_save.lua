-- The claim holder checkpoints a running task, and may move it on (end it, or pause it).
-- LEGAL, TERMINAL: this script's rows of overnight.coordinator.tasks.states, compiled in above.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream   KEYS[4] claim index (zset)
-- KEYS[5] ended index (zset)   KEYS[6] charged request ids (set)   KEYS[7] queued index (zset)
-- ARGV[1] claim token   ARGV[2] checkpoint JSON   ARGV[3] target state ('running' = it goes on)
-- ARGV[4] detail   ARGV[5] receipt stream maxlen   ARGV[6] task id   ARGV[7] retention (s)
-- ARGV[8] seconds before recovery checks a task put back in the queue
-- ARGV[9..] receipts to append, as kind, body pairs
-- Returns {1, now} (Redis server time, as written) or {0, reason}: illegal:<target> |
-- lost (claim gone or not ours) | state:<state>.
-- Any change of state releases the claim; a terminal one also sets ended_unix (server time)
-- and starts the record's retention.
local from = LEGAL[ARGV[3]]
if not from then return {0, 'illegal:' .. ARGV[3]} end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0, 'lost'} end
local state = redis.call('HGET', KEYS[1], 'state')
if not (state and from[state]) then return {0, 'state:' .. tostring(state)} end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[2], 'updated_unix', now)
if ARGV[3] ~= state then
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'detail', ARGV[4])
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[4], ARGV[6])
  if ARGV[3] == 'queued' then redis.call('ZADD', KEYS[7], tonumber(now) + tonumber(ARGV[8]), ARGV[6]) end
end
if TERMINAL[ARGV[3]] then
  redis.call('HSET', KEYS[1], 'ended_unix', now)
  redis.call('ZADD', KEYS[5], now, ARGV[6])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('EXPIRE', KEYS[6], ARGV[7])
end
for i = 9, #ARGV, 2 do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'kind', ARGV[i], 'data', ARGV[i + 1])
end
return {1, now}
