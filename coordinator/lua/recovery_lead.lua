-- Take or keep the recovery lead of a namespace: one process at a time runs recovery passes.
-- KEYS[1] leader key   ARGV[1] this process's token   ARGV[2] lead TTL (ms)
-- Returns 1 if the caller leads now (the lead is renewed), 0 if another process does.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
