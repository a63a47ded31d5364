-- While a stream runs past its hold: hold `chunk` more tokens from the envelope and the
-- task's caps, all or nothing. A refusal is remembered on the grant (the stream is cut with
-- the format's error event, and the step is ended) and leaves a call_refused receipt.
-- KEYS[1] grant hash   KEYS[2] envelope hash   KEYS[3] reservations zset
-- KEYS[4] receipt stream   KEYS[5] task hash (optional)
-- ARGV[1] receipt context (JSON)  ARGV[2] hold member ('id:tokens:N')  ARGV[3] chunk (>= 1)
-- ARGV[4] hold ttl (ms)  ARGV[5] route
-- Returns {1, 'ok', new member} or {0, reason, detail}: reason is lost (the hold expired or
--   was settled) | tokens (the envelope's cap) | max_tokens (the task's) | bad-args | corrupt.
local id, held = string.match(ARGV[2], '^([%w-]+):tokens:(%d+)$')
local chunk, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
if not id or bad_units(chunk, 1) or bad_units(ttl, 1) then return {0, 'bad-args', ''} end
local now = now_ms()
local v = load(KEYS[2])
if not v then return {0, 'corrupt', 'the envelope record is corrupt'} end
v = sweep(KEYS[2], KEYS[3], v, now)
if not redis.call('ZSCORE', KEYS[3], ARGV[2]) then
  return {0, 'lost', 'the hold of this request is no longer open'}
end
local g = redis.call('HMGET', KEYS[1], 'max_tokens', 'envelope', 'task_id')
local why, detail = nil, nil
local left = tokens_left(v)
if left and left < chunk then
  why = 'tokens'
  detail = 'envelope ' .. (g[2] or '?') .. ': token cap reached mid-stream (max_tokens=' ..
    v[9] .. ')'
end
local task = KEYS[5]
if not why and task and g[1] then
  local t = redis.call('HMGET', task, 'tokens_used', 'tokens_held')
  if tonumber(g[1]) - tonumber(t[1] or '0') - tonumber(t[2] or '0') < chunk then
    why = 'max_tokens'
    detail = 'task ' .. (g[3] or '?') .. ': max_tokens (' .. g[1] .. ') reached mid-stream'
  end
end
if why then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'refused', detail) end
  receipt(KEYS[4], ARGV[1], 'call_refused', {kind = 'model', reason = why, detail = detail,
    route = ARGV[5], mid_stream = true, who = why == 'max_tokens' and 'task' or 'envelope'})
  return {0, why, detail}
end
local member = id .. ':tokens:' .. fmt(tonumber(held) + chunk)
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[3], fmt(now + ttl), member)
redis.call('HINCRBY', KEYS[2], 'reserved_tokens', chunk)
if task then redis.call('HINCRBY', task, 'tokens_held', chunk) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'progress_ms', fmt(now)) end
return {1, 'ok', member}
