-- Admit a call to a provider, or refuse it while its circuit is open.
-- KEYS[1] breaker hash {state, failures, open_until}   KEYS[2] probe leases (zset token -> ms)
-- ARGV[1] max probes   ARGV[2] probe lease ms   ARGV[3] token
-- Returns {allowed 0|1, probe 0|1, retry_after_ms, state_before, state_after}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HGET', KEYS[1], 'state') or 'closed'
if state == 'closed' then
  return {1, 0, 0, 'closed', 'closed'}
end
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
if state == 'open' and now < open_until then
  return {0, 0, open_until - now, 'open', 'open'}
end
local before = state
if state == 'open' then
  redis.call('HSET', KEYS[1], 'state', 'half_open')
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
  return {1, 1, 0, before, 'half_open'}
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
return {0, 0, math.max(tonumber(first[2]) - now, 1), before, 'half_open'}
