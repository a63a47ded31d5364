-- After a model request: settle its token hold (charge `tokens`, give back the rest), charge
-- one tool unit per tool call the model asked for, or refund the model unit of a request
-- that was never answered; and append its model_call receipt. Once per hold.
-- KEYS[1] grant hash   KEYS[2] envelope hash   KEYS[3] reservations zset
-- KEYS[4] receipt stream   KEYS[5] task hash (optional)
-- ARGV[1] receipt context (JSON)  ARGV[2] hold member ('id:tokens:N')  ARGV[3] tokens spent
-- ARGV[4] tool units  ARGV[5] '1' = refund the request's model unit (it was not answered)
-- ARGV[6] '1' = that unit was the step's prepaid floor  ARGV[7] model_call receipt data (JSON)
-- Returns {1, tools charged} or {0, 'bad-args'}. Tool units past what is left are not
-- charged: the grant is refused instead, so the lease's next request is refused.
local tokens, tools = tonumber(ARGV[3]), tonumber(ARGV[4])
local hold = tonumber(string.match(ARGV[2], ':tokens:(%d+)$') or '')
if not hold or bad_units(tokens, 0) or bad_units(tools, 0) then return {0, 'bad-args'} end
local task = KEYS[5]
local v = load(KEYS[2])
if v then
  -- A hold that expired was already given back by a sweep: do not give it back twice.
  if redis.call('ZREM', KEYS[3], ARGV[2]) == 1 then
    redis.call('HINCRBY', KEYS[2], 'reserved_tokens', -hold)
  end
  redis.call('HINCRBY', KEYS[2], 'consumed_tokens', tokens)
end
if task then
  local held = tonumber(redis.call('HGET', task, 'tokens_held') or '0')
  redis.call('HSET', task, 'tokens_held', fmt(math.max(0, held - hold)))
  redis.call('HINCRBY', task, 'tokens_used', tokens)
end
if ARGV[5] == '1' then
  if ARGV[6] == '1' then
    if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'prepaid', '1') end
  else
    if v and v[1] ~= '' then
      redis.call('HINCRBY', KEYS[2], 'remaining', 1)
      redis.call('HINCRBY', KEYS[2], 'consumed_model', -1)
    end
    if task then redis.call('HINCRBY', task, 'calls_used', -1) end
  end
end
local charged = 0
if tools > 0 then
  local room = tools
  if v and v[1] ~= '' then
    room = math.max(0, math.min(tools, tonumber(redis.call('HGET', KEYS[2], 'remaining'))))
  else
    room = 0
  end
  local cap = redis.call('HGET', KEYS[1], 'max_calls')
  if task and cap then
    local used = tonumber(redis.call('HGET', task, 'calls_used') or '0')
    room = math.max(0, math.min(room, tonumber(cap) - used))
  end
  if room > 0 then
    redis.call('HINCRBY', KEYS[2], 'remaining', -room)
    redis.call('HINCRBY', KEYS[2], 'consumed_tool', room)
    if task then redis.call('HINCRBY', task, 'calls_used', room) end
  end
  charged = room
  if room < tools and redis.call('EXISTS', KEYS[1]) == 1 then
    local detail = 'no calls left for ' .. fmt(tools - room) .. ' tool call(s) the model asked for'
    redis.call('HSET', KEYS[1], 'refused', detail)
    receipt(KEYS[4], ARGV[1], 'call_refused', {kind = 'tool', reason = 'empty',
      detail = detail, who = 'envelope'})
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- An answer coming back is the step's progress too (the keeper reads progress_ms).
  redis.call('HSET', KEYS[1], 'progress_ms', fmt(now_ms()))
end
local data = cjson.decode(ARGV[7])
data.tool_units_charged = charged
receipt(KEYS[4], ARGV[1], 'model_call', data)
return {1, charged}
