-- Shared library of the envelope scripts (and the gateway's): loaded before each of them.
-- The envelope hash holds the eleven FIELDS below (the max_* fields only when capped).
-- An open reservation is a member 'id:kind:units' of the reservations zset, scored by its
-- expiry in server ms; reserved_<kind> always equals the units of the open members.
-- Tokens (input + output, for the gateway) are not units: an open reservation of kind
-- 'tokens' holds reserved_tokens against max_tokens and never touches `remaining`.
-- Replies are one JSON object (see reply below); the same text is what a request id stores,
-- so a repeated call is answered with it again.
local FIELDS = {'remaining', 'consumed_model', 'consumed_tool', 'reserved_model',
  'reserved_tool', 'max_model', 'max_tool', 'budget', 'max_tokens', 'consumed_tokens',
  'reserved_tokens'}
-- Positions in FIELDS of each kind's consumed, reserved and max fields.
local AT = {model = {2, 4, 6}, tool = {3, 5, 7}}
-- Integers up to 2^53 stay exact in Lua's doubles.
local MAX_UNITS = 9007199254740992

local function fmt(n) return string.format('%.0f', n) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The state as strings (the FIELDS, in order), '' for an absent field; nil if the record is corrupt (a key of
-- another type, or a field that is not a whole number). Scripts check this before they
-- write anything, since a script that fails half-way keeps its earlier writes.
local function load(hash)
  local v = redis.pcall('HMGET', hash, 'remaining', 'consumed_model', 'consumed_tool',
    'reserved_model', 'reserved_tool', 'max_model', 'max_tool', 'budget', 'max_tokens',
    'consumed_tokens', 'reserved_tokens')
  if v.err then return nil end
  for i = 1, 11 do
    local x = v[i]
    if not x then
      v[i] = ''
    elseif #x > 17 or not string.find(x, '^%-?%d+$') then
      return nil
    end
  end
  return v
end

-- Give back the units of reservations that expired uncommitted; returns the fresh state.
-- Only touches the zset while some reservation is open, so plain consumes stay cheap.
local function sweep(hash, zset, v, now)
  if (tonumber(v[4]) or 0) + (tonumber(v[5]) or 0) + (tonumber(v[11]) or 0) <= 0 then
    return v
  end
  local due = redis.call('ZRANGEBYSCORE', zset, '-inf', now or now_ms(), 'LIMIT', 0, 256)
  if #due == 0 then return v end
  for _, member in ipairs(due) do
    local _, kind, units = string.match(member, '^(.-):(%a+):(%d+)$')
    if kind then
      if kind ~= 'tokens' then redis.call('HINCRBY', hash, 'remaining', units) end
      redis.call('HINCRBY', hash, 'reserved_' .. kind, '-' .. units)
    end
    redis.call('ZREM', zset, member)
  end
  return load(hash)
end

-- Why `units` of `kind` cannot be taken from state `v`, or nil if they can.
local function refusal(v, kind, units)
  if v[1] == '' then return 'unknown' end
  local remaining = tonumber(v[1])
  if remaining <= 0 then return 'empty' end
  if remaining < units then return 'short' end
  local at = AT[kind]
  local used = (tonumber(v[at[1]]) or 0) + (tonumber(v[at[2]]) or 0)
  if v[at[3]] ~= '' and used + units > tonumber(v[at[3]]) then return 'cap' end
  return nil
end

-- {allowed, reason, state = {field = its value as a string, '' if absent}, member,
-- expires_ms} as JSON; member and expires_ms only for a reservation taken.
local function reply(allowed, reason, v, member, expires_ms)
  local state = {}
  for i = 1, 11 do state[FIELDS[i]] = v[i] end
  return cjson.encode({allowed = allowed, reason = reason, state = state, member = member,
    expires_ms = expires_ms})
end

-- A refusal decided before the state was read (or of a corrupt state): {allowed, reason}.
local function refused(reason)
  return cjson.encode({allowed = false, reason = reason})
end

-- The answer a request id stored, marked as replayed.
local function replayed(first)
  local answer = cjson.decode(first)
  answer.replayed = true
  return cjson.encode(answer)
end

-- Tokens still free under the cap (nil when there is no token cap).
local function tokens_left(v)
  if v[9] == '' then return nil end
  return tonumber(v[9]) - (tonumber(v[10]) or 0) - (tonumber(v[11]) or 0)
end

-- Append a receipt; ctx is the caller's JSON {envelope, host, task_id, lease_id, maxlen}.
local function receipt(stream, ctx, kind, data)
  local c = cjson.decode(ctx)
  data.envelope = c.envelope
  local body = cjson.encode({ts = now_ms() / 1000, host = c.host, task_id = c.task_id,
    lease_id = c.lease_id, data = data})
  redis.call('XADD', stream, 'MAXLEN', '~', c.maxlen, '*', 'kind', kind, 'data', body)
end

local function bad_units(n, min)
  return not n or n < min or n > MAX_UNITS or n % 1 ~= 0
end
