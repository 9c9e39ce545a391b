-- Fair dispatch across tenants. A run's message goes to the run queue at once while fewer
-- runs are held (on their way there, sent and not yet claimed, or running on a worker) than
-- the live workers have slots and no tenant has runs lined up; else the run joins its
-- tenant's line. Whenever a run ends or leaves (`done`), a worker (re)registers its slots,
-- or a run is offered, the lines refill what is held up to the slots: stride scheduling
-- across tenants (each sent run, from a line or at once, moves its tenant's pass on by
-- 1 / weight; the lowest pass goes next; a tenant whose line was empty starts at the later
-- of its own pass and the pass last served, so it keeps what it used and banks nothing
-- while idle), highest priority first within a tenant's line, then first come.
-- Beyond the slots, the workers keep reserve threads: a run of a tenant with no line, whose
-- pass is not behind the first line's, goes at once onto one of them while other tenants'
-- runs are lined (it would be the next served anyway, and need not wait for a slot to free).
-- KEYS[1] sent (zset run -> ms sent)   KEYS[2] lines (zset tenant -> pass)
-- KEYS[3] messages (hash run -> message to push)   KEYS[4] lined (hash run -> tenant)
-- KEYS[5] state (hash: vt, ticket, w:<tenant> weight, p:<tenant> pass of an idle tenant)
-- KEYS[6] workers (zset worker -> ms its registration ends)   KEYS[7] slots (hash worker -> n)
-- KEYS[8] the run queue (list) or '' when messages are sent by the caller
-- KEYS[9] running (zset run -> ms its worker last said so)   KEYS[10] reserves (hash worker -> n)
-- KEYS[11] jumped (hash run -> 1: sent onto a reserve thread; dropped once no longer held)
-- ARGV[1] op   ARGV[2] prefix of the lines' keys (a tenant's line: prefix .. tenant)
-- ARGV[3] ms after which a sent run that no worker claimed counts as lost
-- ARGV[4] ms after which a running run its worker no longer names counts as gone
--   offer:    ARGV[5] run  ARGV[6] tenant  ARGV[7] priority (0-9)  ARGV[8] message or ''
--             -> {1 sent now | 0 lined | 2 on its way already | 3 in its line already,
--                 run ids the caller sends...}
--   take:     ARGV[5] run (claimed by a worker: running now)         -> {0, run ids to send...}
--   done:     ARGV[5] run (ended or dropped on a worker, or canceled in its line)
--                                                                    -> {0, run ids to send...}
--   register: ARGV[5] worker ('': weights only)  ARGV[6] slots  ARGV[7] ms  ARGV[8] reserve
--             ARGV[9] n  ARGV[10..] n tenant, weight pairs, then the runs the worker runs
--                                                                    -> {0, run ids to send...}
--   leave:    ARGV[5] worker                                         -> {0}
--   depth:    -> {sent, lined, tenants with lines, slots (-1: no worker registered), running,
--                 reserve}
--   lines:    -> {tenant, runs in its line, tenant, runs, ...} (read only: tenants with runs lined)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sent, lines, messages, lined, state = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local workers, slots, queue = KEYS[6], KEYS[7], KEYS[8]
local running, reserves, jumped = KEYS[9], KEYS[10], KEYS[11]
local op, prefix = ARGV[1], ARGV[2]
local lost_ms, gone_ms = tonumber(ARGV[3]), tonumber(ARGV[4])

local function sum(hash)
  local total, any = 0, false
  for _, n in ipairs(redis.call('HVALS', hash)) do
    total, any = total + tonumber(n), true
  end
  return total, any
end

-- the live workers' slots (nil: none registered) and reserve threads
local function capacity()
  local gone = redis.call('ZRANGEBYSCORE', workers, '-inf', now)
  for _, worker in ipairs(gone) do
    redis.call('HDEL', slots, worker)
    redis.call('HDEL', reserves, worker)
  end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', workers, '-inf', now) end
  local total, any = sum(slots)
  if not any then return nil, 0 end
  return total, (sum(reserves))
end

-- runs on their way or running; those whose place timed out free it
local function held()
  redis.call('ZREMRANGEBYSCORE', sent, '-inf', now - lost_ms)
  redis.call('ZREMRANGEBYSCORE', running, '-inf', now - gone_ms)
  return redis.call('ZCARD', sent) + redis.call('ZCARD', running)
end

-- of those, the runs on a reserve thread (a few at most)
local function on_reserve()
  local n = 0
  for _, run in ipairs(redis.call('HKEYS', jumped)) do
    if redis.call('ZSCORE', sent, run) or redis.call('ZSCORE', running, run) then
      n = n + 1
    else
      redis.call('HDEL', jumped, run)
    end
  end
  return n
end

local function weight(tenant)
  return tonumber(redis.call('HGET', state, 'w:' .. tenant) or '1')
end

-- where a tenant without a line starts: the later of its own pass and the pass last served
local function start_pass(tenant)
  local idle = tonumber(redis.call('HGET', state, 'p:' .. tenant) or '0')
  return math.max(idle, tonumber(redis.call('HGET', state, 'vt') or '0'))
end

-- a run of a tenant without a line sent at once: its pass moves on as a served one's would
local function served_at_once(tenant)
  local start = start_pass(tenant)
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
  local cap = capacity()
  if cap == nil then return out end  -- no live worker: the lines wait for one
  local n = held() - on_reserve()  -- the slots' runs
  while n < cap do
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
      n = n + 1
    end
  end
  return out
end

-- the run leaves its line if it is in one; whether it was
local function unline(run)
  local tenant = redis.call('HGET', lined, run)
  if not tenant then return false end
  redis.call('ZREM', prefix .. tenant, run)
  redis.call('HDEL', lined, run)
  redis.call('HDEL', messages, run)
  if redis.call('ZCARD', prefix .. tenant) == 0 then redis.call('ZREM', lines, tenant) end
  return true
end

local function refilled()
  local reply = {0}
  for _, id in ipairs(refill({})) do reply[#reply + 1] = id end
  return reply
end

if op == 'offer' then
  local run, tenant, priority, message = ARGV[5], ARGV[6], tonumber(ARGV[7]), ARGV[8]
  local n = held()
  if redis.call('ZSCORE', sent, run) then
    return {2}  -- a re-send of a run on its way: it keeps its place
  end
  if redis.call('HGET', lined, run) then
    return {3}  -- a re-send of a run in its line: it keeps its place there
  end
  local cap, reserve = capacity()
  local others, reserved = redis.call('ZCARD', lines), on_reserve()
  local at_once = cap == nil or (others == 0 and n - reserved < cap)
  if not at_once and others > 0 and reserved < reserve and not redis.call('ZSCORE', lines, tenant) then
    local top = redis.call('ZRANGE', lines, 0, 0, 'WITHSCORES')
    if start_pass(tenant) <= tonumber(top[2]) then  -- its turn: onto a reserve thread
      redis.call('HSET', jumped, run, 1)
      at_once = true
    end
  end
  if at_once then
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
    redis.call('ZADD', lines, start_pass(tenant), tenant)
  end
  local reply = refilled()
  if redis.call('ZSCORE', sent, run) then reply[1] = 1 end
  return reply
elseif op == 'take' then
  local run = ARGV[5]
  local was_sent = redis.call('ZREM', sent, run) == 1
  if unline(run) or was_sent then  -- (unline: a stale message of a lined run, claimed first)
    redis.call('ZADD', running, now, run)
  end
  return refilled()
elseif op == 'done' then
  local run = ARGV[5]
  redis.call('ZREM', sent, run)
  redis.call('ZREM', running, run)
  redis.call('HDEL', jumped, run)
  unline(run)
  return refilled()
elseif op == 'register' then
  local worker, n, ms = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
  local reserve, weights = tonumber(ARGV[8]), tonumber(ARGV[9])
  if worker ~= '' then  -- '' only sets weights
    redis.call('ZADD', workers, now + ms, worker)
    redis.call('HSET', slots, worker, n)
    redis.call('HSET', reserves, worker, reserve)
  end
  local last = 9 + 2 * weights
  for i = 10, last - 1, 2 do
    redis.call('HSET', state, 'w:' .. ARGV[i], ARGV[i + 1])
  end
  for i = last + 1, #ARGV do  -- still running there: their places stay taken
    redis.call('ZADD', running, 'XX', now, ARGV[i])
  end
  return refilled()
elseif op == 'leave' then
  redis.call('ZREM', workers, ARGV[5])
  redis.call('HDEL', slots, ARGV[5])
  redis.call('HDEL', reserves, ARGV[5])
  return {0}
elseif op == 'depth' then
  local n = held()
  local cap, reserve = capacity()
  return {redis.call('ZCARD', sent), redis.call('HLEN', lined), redis.call('ZCARD', lines),
          cap == nil and -1 or cap, redis.call('ZCARD', running), reserve}
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
