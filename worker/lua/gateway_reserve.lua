-- Before the gateway forwards a model request: check the lease's grant, then take one model
-- unit (or the step's prepaid floor unit) and a token hold from the shared envelope and the
-- task's caps, all or nothing. A refusal is remembered on the grant (every later request of
-- the lease is refused without a charge) and leaves a call_refused receipt.
-- KEYS[1] grant hash   KEYS[2] lease hash   KEYS[3] envelope hash   KEYS[4] reservations zset
-- KEYS[5] receipt stream   KEYS[6] task hash (optional: only for a task's step)
-- ARGV[1] receipt context (JSON)  ARGV[2] tokens to hold (>= 1)
-- ARGV[3] hold id  ARGV[4] hold ttl (ms)  ARGV[5] route
-- Returns {1, 'ok', hold, prepaid ('1'|'0'), member} or {0, reason, detail}: reason is ended
--   (no grant, or the lease is not running) | refused (refused before) | bad-args | corrupt
--   | empty | short | cap | unknown | tokens (the envelope's) | max_calls | max_tokens (the
--   task's).
local g = redis.call('HMGET', KEYS[1], 'lease_token', 'max_calls', 'max_tokens', 'prepaid',
  'refused', 'envelope', 'task_id')
if not g[1] then return {0, 'ended', 'the lease of this token has ended'} end
if g[5] then return {0, 'refused', g[5]} end
local l = redis.call('HMGET', KEYS[2], 'status', 'token')
if l[1] ~= 'running' or l[2] ~= g[1] then
  return {0, 'ended', 'the lease of this token has ended'}
end
local want, ttl = tonumber(ARGV[2]), tonumber(ARGV[4])
if bad_units(want, 1) or bad_units(ttl, 1) or not string.match(ARGV[3], '^[%w-]+$') then
  return {0, 'bad-args', 'bad arguments'}
end
local now = now_ms()
local v = load(KEYS[3])
if not v then return {0, 'corrupt', 'the envelope record is corrupt'} end
v = sweep(KEYS[3], KEYS[4], v, now)
local prepaid = g[4] == '1'
local name, task = g[6], KEYS[6]
local why, detail = nil, nil
if not prepaid then
  why = refusal(v, 'model', 1)
  if why then
    detail = 'envelope ' .. name .. ': ' .. why .. '; refused model call; remaining=' ..
      (v[1] == '' and '0' or v[1])
  end
end
-- A request is forwarded only if its whole hold fits: the cap is passed only by output
-- beyond what was held (docs/agents.md, "Metering real agents").
local hold = want
local left = tokens_left(v)
if not why and left and left < hold then
  why, detail = 'tokens', 'envelope ' .. name .. ': token cap reached (max_tokens=' .. v[9] ..
    ', ' .. fmt(math.max(0, left)) .. ' left, this request holds ' .. fmt(hold) .. ')'
end
local used, spent, held = 0, 0, 0
if not why and task then
  local t = redis.call('HMGET', task, 'calls_used', 'tokens_used', 'tokens_held')
  used, spent, held = tonumber(t[1] or '0'), tonumber(t[2] or '0'), tonumber(t[3] or '0')
  if not prepaid and g[2] and used >= tonumber(g[2]) then
    why = 'max_calls'
    detail = 'task ' .. g[7] .. ': max_calls (' .. g[2] .. ') reached; refused model call'
  elseif g[3] and tonumber(g[3]) - spent - held < hold then
    why = 'max_tokens'
    detail = 'task ' .. g[7] .. ': max_tokens (' .. g[3] .. ') reached; refused model call'
  end
end
if why then
  redis.call('HSET', KEYS[1], 'refused', detail)
  receipt(KEYS[5], ARGV[1], 'call_refused', {kind = 'model', reason = why, detail = detail,
    route = ARGV[5], who = (why == 'max_calls' or why == 'max_tokens') and 'task' or 'envelope'})
  return {0, why, detail}
end
if prepaid then
  redis.call('HSET', KEYS[1], 'prepaid', '0')
else
  v[1] = fmt(tonumber(v[1]) - 1)
  v[2] = fmt((tonumber(v[2]) or 0) + 1)
  redis.call('HSET', KEYS[3], 'remaining', v[1], 'consumed_model', v[2])
  if task then redis.call('HINCRBY', task, 'calls_used', 1) end
end
-- A request going out is the step's progress (the keeper reads progress_ms).
redis.call('HSET', KEYS[1], 'progress_ms', fmt(now))
local member = ARGV[3] .. ':tokens:' .. fmt(hold)
redis.call('HINCRBY', KEYS[3], 'reserved_tokens', hold)
redis.call('ZADD', KEYS[4], fmt(now + ttl), member)
if task then redis.call('HINCRBY', task, 'tokens_held', hold) end
return {1, 'ok', hold, prepaid and '1' or '0', member}
