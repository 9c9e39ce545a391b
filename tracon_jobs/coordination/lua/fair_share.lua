-- Fair dispatch across tenants. A run's message goes to the run queue at once while fewer
-- runs are on their way there (sent, not yet claimed) than the live workers have slots and
-- no tenant has runs lined up; else the run joins its tenant's line. Whenever a run is
-- claimed, a worker (re)registers its slots, or a run is offered, the lines refill what is
-- on its way up to the slots: stride scheduling across tenants (each sent run, from a line
-- or at once, moves its tenant's pass on by 1 / weight; the lowest pass goes next; a tenant
-- whose line was empty starts at the later of its own pass and the pass last served, so it
-- keeps what it used and banks nothing while idle), highest priority first within a
-- tenant's line, then first come.
-- KEYS[1] sent (zset run -> ms sent)   KEYS[2] lines (zset tenant -> pass)
-- KEYS[3] messages (hash run -> message to push)   KEYS[4] lined (hash run -> tenant)
-- KEYS[5] state (hash: vt, ticket, w:<tenant> weight, p:<tenant> pass of an idle tenant)
-- KEYS[6] workers (zset worker -> ms its registration ends)   KEYS[7] slots (hash worker -> n)
-- KEYS[8] the run queue (list) or '' when messages are sent by the caller
-- ARGV[1] op   ARGV[2] prefix of the lines' keys (a tenant's line: prefix .. tenant)
-- ARGV[3] ms after which a sent run that no worker claimed counts as lost
--   offer:    ARGV[4] run  ARGV[5] tenant  ARGV[6] priority (0-9)  ARGV[7] message or ''
--             -> {1 sent now | 0 lined | 2 on its way already, run ids the caller sends...}
--   take:     ARGV[4] run (claimed by a worker)                      -> {0, run ids to send...}
--   register: ARGV[4] worker ('': weights only)  ARGV[5] slots  ARGV[6] ms  ARGV[7..] tenant, weight, ...
--                                                                    -> {0, run ids to send...}
--   leave:    ARGV[4] worker                                         -> {0}
--   depth:    -> {sent, lined, tenants with lines, slots (-1: no worker registered)}
--   lines:    -> {tenant, runs in its line, tenant, runs, ...} (read only: tenants with runs lined)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sent, lines, messages, lined, state = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local workers, slots, queue = KEYS[6], KEYS[7], KEYS[8]
local op, prefix, lost_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])

local function capacity()
  local gone = redis.call('ZRANGEBYSCORE', workers, '-inf', now)
  for _, worker in ipairs(gone) do redis.call('HDEL', slots, worker) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', workers, '-inf', now) end
  local total, any = 0, false
  for _, n in ipairs(redis.call('HVALS', slots)) do
    total, any = total + tonumber(n), true
  end
  if not any then return nil end
  return total
end

local function weight(tenant)
  return tonumber(redis.call('HGET', state, 'w:' .. tenant) or '1')
end

-- a run of an idle tenant (no line) sent at once: its pass moves on as a served one's would
local function served_at_once(tenant)
  local idle = tonumber(redis.call('HGET', state, 'p:' .. tenant) or '0')
  local start = math.max(idle, tonumber(redis.call('HGET', state, 'vt') or '0'))
  redis.call('HSET', state, 'vt', tostring(start))
  redis.call('HSET', state, 'p:' .. tenant, tostring(start + 1 / weight(tenant)))
end

local function send(run, out)
  redis.call('ZADD', sent, now, run)
  local message = redis.call('HGET', messages, run)
  if message then
    redis.call('HDEL', messages, run)
    if queue ~= '' then
      redis.call('LPUSH', queue, message)
      return
    end
  end
  out[#out + 1] = run
end

local function refill(out)
  redis.call('ZREMRANGEBYSCORE', sent, '-inf', now - lost_ms)
  local cap = capacity()
  if cap == nil then return out end  -- no live worker: the lines wait for one
  while redis.call('ZCARD', sent) < cap do
    local top = redis.call('ZRANGE', lines, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local tenant, pass = top[1], tonumber(top[2])
    local line = prefix .. tenant
    local first = redis.call('ZPOPMIN', line)
    if #first == 0 then
      redis.call('ZREM', lines, tenant)
    else
      local run = first[1]
      local after = pass + 1 / weight(tenant)
      redis.call('HSET', state, 'vt', tostring(pass))
      if redis.call('ZCARD', line) == 0 then
        redis.call('ZREM', lines, tenant)
        redis.call('HSET', state, 'p:' .. tenant, tostring(after))
      else
        redis.call('ZADD', lines, after, tenant)
      end
      redis.call('HDEL', lined, run)
      send(run, out)
    end
  end
  return out
end

local function unline(run)
  local tenant = redis.call('HGET', lined, run)
  if tenant then
    redis.call('ZREM', prefix .. tenant, run)
    redis.call('HDEL', lined, run)
    redis.call('HDEL', messages, run)
    if redis.call('ZCARD', prefix .. tenant) == 0 then redis.call('ZREM', lines, tenant) end
  end
end

if op == 'offer' then
  local run, tenant, priority, message = ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
  redis.call('ZREMRANGEBYSCORE', sent, '-inf', now - lost_ms)
  if redis.call('ZSCORE', sent, run) or redis.call('HGET', lined, run) then
    return {2}  -- a re-send of a run on its way, or in its line: it keeps its place
  end
  local cap = capacity()
  if cap == nil or (redis.call('ZCARD', lines) == 0 and redis.call('ZCARD', sent) < cap) then
    redis.call('ZADD', sent, now, run)
    if cap ~= nil then served_at_once(tenant) end
    if message ~= '' and queue ~= '' then
      redis.call('LPUSH', queue, message)
      return {1}
    end
    return {1, run}
  end
  local ticket = redis.call('HINCRBY', state, 'ticket', 1)
  redis.call('ZADD', prefix .. tenant, (9 - priority) * 1e12 + ticket, run)
  redis.call('HSET', lined, run, tenant)
  if message ~= '' then redis.call('HSET', messages, run, message) end
  if not redis.call('ZSCORE', lines, tenant) then
    local idle = tonumber(redis.call('HGET', state, 'p:' .. tenant) or '0')
    local vt = tonumber(redis.call('HGET', state, 'vt') or '0')
    redis.call('ZADD', lines, math.max(idle, vt), tenant)
  end
  local out = refill({})
  local reply = {0}
  for _, id in ipairs(out) do reply[#reply + 1] = id end
  if redis.call('ZSCORE', sent, run) then reply[1] = 1 end
  return reply
elseif op == 'take' then
  local run = ARGV[4]
  redis.call('ZREM', sent, run)
  unline(run)  -- a stale message of a run still in its line, claimed first
  local reply = {0}
  for _, id in ipairs(refill({})) do reply[#reply + 1] = id end
  return reply
elseif op == 'register' then
  local worker, n, ms = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  if worker ~= '' then  -- '' only sets weights
    redis.call('ZADD', workers, now + ms, worker)
    redis.call('HSET', slots, worker, n)
  end
  for i = 7, #ARGV - 1, 2 do
    redis.call('HSET', state, 'w:' .. ARGV[i], ARGV[i + 1])
  end
  local reply = {0}
  for _, id in ipairs(refill({})) do reply[#reply + 1] = id end
  return reply
elseif op == 'leave' then
  redis.call('ZREM', workers, ARGV[4])
  redis.call('HDEL', slots, ARGV[4])
  return {0}
elseif op == 'depth' then
  local cap = capacity()
  return {redis.call('ZCARD', sent), redis.call('HLEN', lined), redis.call('ZCARD', lines),
          cap == nil and -1 or cap}
elseif op == 'lines' then
  local reply = {}
  for _, tenant in ipairs(redis.call('ZRANGE', lines, 0, -1)) do
    local n = redis.call('ZCARD', prefix .. tenant)
    if n > 0 then
      reply[#reply + 1] = tenant
      reply[#reply + 1] = n
    end
  end
  return reply
end
return redis.error_reply('fair_share: unknown op ' .. tostring(op))
