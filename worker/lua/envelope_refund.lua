-- Give back the units a request id was charged for a call that was never made (a step that
-- never started): they return to `remaining`, the consumed counter goes down, and the request
-- id forgets its answer (a later consume under it is judged afresh). Once per charge.
-- KEYS[1] envelope hash   KEYS[2] receipt stream   KEYS[3] request-id key
-- ARGV[1] receipt context (JSON: envelope, host, task_id, lease_id, maxlen)
-- ARGV[2] kind: model | tool   ARGV[3] units (>= 1)   ARGV[4] request id
-- Returns 1 if units were given back; 0 if the request id holds no charge (never charged,
-- refused, given back already, or forgotten after its ttl), or the kind or units are bad.
local field = ({model = 'consumed_model', tool = 'consumed_tool'})[ARGV[2]]
local units = tonumber(ARGV[3])
if not field or not units or units < 1 or units % 1 ~= 0 then return 0 end
local first = redis.call('GET', KEYS[3])
if not first then return 0 end
-- The stored answer is the consume script's reply: allowed is its first field, or its JSON key.
local allowed = string.sub(first, 1, 2) == '1|' or string.find(first, '"allowed":true', 1, true)
if not allowed then return 0 end
local v = redis.call('HMGET', KEYS[1], 'remaining', field)
local remaining, used = tonumber(v[1]), tonumber(v[2] or '0')
if not remaining or not used then return 0 end
redis.call('DEL', KEYS[3])
remaining = remaining + units
used = math.max(0, used - units)
redis.call('HSET', KEYS[1], 'remaining', string.format('%.0f', remaining), field,
  string.format('%.0f', used))
local t = redis.call('TIME')
local c = cjson.decode(ARGV[1])
local body = cjson.encode({ts = tonumber(t[1]) + tonumber(t[2]) / 1000000, host = c.host,
  task_id = c.task_id, lease_id = c.lease_id, data = {envelope = c.envelope, kind = ARGV[2],
  units = units, remaining = remaining, request_id = ARGV[4]}})
redis.call('XADD', KEYS[2], 'MAXLEN', '~', c.maxlen, '*', 'kind', 'envelope_refunded',
  'data', body)
return 1
