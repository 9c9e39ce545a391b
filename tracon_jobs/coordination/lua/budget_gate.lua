-- Check a tree's budget before a model call, a tool call or a child run, and reserve.
-- KEYS[1] budget hash {tokens, reserved, cost_nanos, children, unknown_price, started_ms}
-- ARGV[1] kind: 'model' | 'tool' | 'child' | 'node' (a workflow function node: cost and
--   time only, it spends no tokens)
-- ARGV[2] token limit (-1 none)   ARGV[3] cost limit nanos (-1 none)
-- ARGV[4] duration limit ms (-1 none)   ARGV[5] run limit (-1 none)
-- ARGV[6] tokens to reserve (model calls; with ARGV[7] >= 0, the call's estimated input)
-- ARGV[7] output tokens the model call asks for (0: as the model decides; -1: reserve
--   ARGV[6] as it is, and cap nothing)   ARGV[8] output reserved when it asks for none
-- ARGV[9] the largest room that caps a call asking for none (beyond it, the request stays
--   as configured: a model's own output ceiling may be lower)
-- ARGV[10] input price, nanos a token (-1 unpriced)   ARGV[11] output price, the same
-- ARGV[12..17] optional: a seed to open the budget with when it does not exist (tokens,
--   cost nanos, children, unknown price '0'|'1', ms already executed, ttl ms), as
--   budget_open does: a fresh tree's first gate opens it, one call instead of two
-- Returns {refused limit name or '' ('?' when the budget is gone), tokens, reserved,
--          cost_nanos, children, elapsed_ms, output cap (0: none), tokens reserved now}
-- The output cap of a model call is the room the tree has left after its spend, the other
-- calls' reservations and this call's input: tokens under MaxTotalTokens, and what the
-- cost left under MaxTotalCost buys at the link's prices; at least 1 (the refusal rules
-- above decide whether the call starts at all).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = KEYS[1]
if redis.call('EXISTS', b) == 0 then
  if not ARGV[12] then
    return {'?', 0, 0, 0, 0, 0, 0, 0}  -- lost (a flushed Redis): the caller re-seeds it from SQL
  end
  redis.call('HSET', b, 'tokens', ARGV[12], 'reserved', 0, 'cost_nanos', ARGV[13],
    'children', ARGV[14], 'unknown_price', ARGV[15], 'started_ms', now - tonumber(ARGV[16]))
  redis.call('PEXPIRE', b, tonumber(ARGV[17]))
end
local tokens = tonumber(redis.call('HGET', b, 'tokens') or '0')
local reserved = tonumber(redis.call('HGET', b, 'reserved') or '0')
local cost = tonumber(redis.call('HGET', b, 'cost_nanos') or '0')
local children = tonumber(redis.call('HGET', b, 'children') or '0')
local unknown = redis.call('HGET', b, 'unknown_price') == '1'
local started = tonumber(redis.call('HGET', b, 'started_ms') or tostring(now))
local elapsed = now - started
local kind = ARGV[1]
local token_limit, cost_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local duration_limit, run_limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local function answer(refused, cap, reserve)
  return {refused, tokens, reserved, cost, children, elapsed, cap or 0, reserve or 0}
end
if kind == 'child' then
  if run_limit >= 0 and children + 1 > run_limit then return answer('MaxTotalRuns') end
  redis.call('HINCRBY', b, 'children', 1)
  children = children + 1
  return answer('')
end
if kind ~= 'node' and token_limit >= 0 and tokens + reserved >= token_limit then
  return answer('MaxTotalTokens')
end
if cost_limit >= 0 and not unknown and cost >= cost_limit then return answer('MaxTotalCost') end
if duration_limit >= 0 and elapsed >= duration_limit then return answer('MaxDuration') end
if kind ~= 'model' then return answer('') end
local reserve, wanted, cap = tonumber(ARGV[6]), tonumber(ARGV[7]), 0
if wanted >= 0 then
  local bounded, room = false, 0
  if token_limit >= 0 then bounded, room = true, token_limit - tokens - reserved - reserve end
  local in_price, out_price = tonumber(ARGV[10]), tonumber(ARGV[11])
  if cost_limit >= 0 and not unknown and out_price > 0 then
    local by_cost = math.floor((cost_limit - cost - reserve * math.max(in_price, 0)) / out_price)
    if not bounded or by_cost < room then bounded, room = true, by_cost end
  end
  room = math.max(room, 1)
  local out = wanted
  if wanted == 0 then out = tonumber(ARGV[8]) end
  if bounded and ((wanted > 0 and room < wanted) or (wanted == 0 and room <= tonumber(ARGV[9]))) then
    cap, out = room, room
  end
  if token_limit >= 0 then reserve = reserve + out else reserve = 0 end
end
if reserve > 0 then redis.call('HINCRBY', b, 'reserved', reserve) end
return answer('', cap, reserve)
