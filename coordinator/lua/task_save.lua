-- The claim holder checkpoints a running task, and may end it in a terminal state.
-- KEYS[1] task hash   KEYS[2] claim key   KEYS[3] receipt stream
-- ARGV[1] claim token   ARGV[2] checkpoint JSON   ARGV[3] new state ('' = still running)
-- ARGV[4] detail   ARGV[5] now   ARGV[6] '1' = the task ends, '2' = it pauses (both release
--   the claim), '0' = it goes on
-- ARGV[7] receipt stream maxlen   ARGV[8..] receipts to append, as kind, body pairs
-- Returns {1} or {0, reason}: lost (claim gone or not ours) | state:<state>.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0, 'lost'} end
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'running' then return {0, 'state:' .. tostring(state)} end
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[2], 'updated_unix', ARGV[5])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'state', ARGV[3], 'detail', ARGV[4]) end
if ARGV[6] == '1' then redis.call('HSET', KEYS[1], 'ended_unix', ARGV[5]) end
if ARGV[6] ~= '0' then redis.call('DEL', KEYS[2]) end
for i = 8, #ARGV, 2 do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'kind', ARGV[i], 'data', ARGV[i + 1])
end
return {1}
