-- Shared prelude of the envelope scripts: worker/envelope.py prepends it to each of them.
-- The envelope hash holds remaining, budget, consumed_model, consumed_tool, reserved_model,
-- reserved_tool and the optional caps max_model, max_tool. An open reservation is a member
-- 'id|kind|units' of the reservations zset, scored by its expiry in server milliseconds.
-- Integers up to 2^53 stay exact in Lua's doubles.
local MAX_UNITS = 9007199254740992
local FIELDS = {'remaining', 'consumed_model', 'consumed_tool', 'reserved_model',
  'reserved_tool', 'max_model', 'max_tool', 'budget'}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- True if the envelope key holds something the scripts cannot count with: another type, or a
-- counter that is not a whole number. Every script checks this before it writes anything,
-- since a script that fails half-way keeps its earlier writes.
local function corrupt(hash)
  local kind = redis.call('TYPE', hash)['ok']
  if kind == 'none' then return false end
  if kind ~= 'hash' then return true end
  local v = redis.call('HMGET', hash, unpack(FIELDS))
  for i = 1, #FIELDS do
    if v[i] and not string.match(v[i], '^%-?%d+$') then return true end
  end
  return false
end

-- Give back the units of reservations that expired uncommitted.
local function sweep(hash, zset, now)
  local due = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, 256)
  for _, member in ipairs(due) do
    local _, kind, units = string.match(member, '^(.-)|(%a+)|(%d+)$')
    if kind and redis.call('EXISTS', hash) == 1 then
      redis.call('HINCRBY', hash, 'remaining', units)
      redis.call('HINCRBY', hash, 'reserved_' .. kind, '-' .. units)
    end
    redis.call('ZREM', zset, member)
  end
end

-- The state as strings ('' for an absent field), exact for any integer HINCRBY accepts.
local function state(hash)
  local v = redis.call('HMGET', hash, unpack(FIELDS))
  for i = 1, #FIELDS do
    if not v[i] then v[i] = '' end
  end
  return v
end

local function answer(allowed, reason, hash, extra1, extra2)
  local out = {allowed, reason}
  for _, v in ipairs(state(hash)) do out[#out + 1] = v end
  out[#out + 1] = extra1 or ''
  out[#out + 1] = extra2 or ''
  return out
end

-- Why `units` of `kind` cannot be taken now, or nil if they can.
local function refusal(hash, kind, units)
  local v = redis.call('HMGET', hash, 'remaining', 'consumed_' .. kind, 'reserved_' .. kind,
    'max_' .. kind)
  if not v[1] then return 'unknown' end
  local remaining = tonumber(v[1])
  if remaining <= 0 then return 'empty' end
  if remaining < units then return 'short' end
  if v[4] and tonumber(v[2]) + tonumber(v[3]) + units > tonumber(v[4]) then return 'cap' end
  return nil
end

local function receipt(stream, maxlen, kind, host, task_id, lease_id, data)
  local body = cjson.encode({ts = now_ms() / 1000, host = host, task_id = task_id,
    lease_id = lease_id, data = data})
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'kind', kind, 'data', body)
end

local function blank(value)
  if value == '' then return nil end
  return value
end
