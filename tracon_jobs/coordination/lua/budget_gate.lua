-- Check a tree's budget before a model call, a tool call or a child run, and reserve.
-- KEYS[1] budget hash {tokens, reserved, cost_nanos, children, unknown_price, started_ms}
-- ARGV[1] kind: 'model' | 'tool' | 'child' | 'node' (a workflow function node: cost and
--   time only, it spends no tokens)
-- ARGV[2] token limit (-1 none)   ARGV[3] cost limit nanos (-1 none)
-- ARGV[4] duration limit ms (-1 none)   ARGV[5] run limit (-1 none)
-- ARGV[6] tokens to reserve (model calls)
-- ARGV[7..12] optional: a seed to open the budget with when it does not exist (tokens,
--   cost nanos, children, unknown price '0'|'1', ms already executed, ttl ms), as
--   budget_open does: a fresh tree's first gate opens it, one call instead of two
-- Returns {refused limit name or '' ('?' when the budget is gone), tokens, reserved,
--          cost_nanos, children, elapsed_ms}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = KEYS[1]
if redis.call('EXISTS', b) == 0 then
  if not ARGV[7] then
    return {'?', 0, 0, 0, 0, 0}  -- lost (a flushed Redis): the caller re-seeds it from SQL
  end
  redis.call('HSET', b, 'tokens', ARGV[7], 'reserved', 0, 'cost_nanos', ARGV[8],
    'children', ARGV[9], 'unknown_price', ARGV[10], 'started_ms', now - tonumber(ARGV[11]))
  redis.call('PEXPIRE', b, tonumber(ARGV[12]))
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
local function answer(refused)
  return {refused, tokens, reserved, cost, children, elapsed}
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
if kind == 'model' and tonumber(ARGV[6]) > 0 then
  redis.call('HINCRBY', b, 'reserved', ARGV[6])
end
return answer('')
