-- Retention: ended tasks whose record has expired leave the task index and the ended index.
-- KEYS[1] task index (zset)   KEYS[2] ended index (zset)   KEYS[i+2] task hash of task i
-- ARGV[i] id of task i (candidates: ended longer ago than the retention)
-- Returns the number of tasks forgotten. A record still there (its retention not yet over,
-- or submitted again) is left alone.
local gone = 0
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[i + 2]) == 0 then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    gone = gone + 1
  end
end
return gone
