-- What a rate limit's window holds now: {starts, their tokens, ms the provider's word still
-- holds calls back}. KEYS[1] starts (zset)   KEYS[2] tokens (hash)   KEYS[3] block
-- ARGV[1] window ms. Starts out of the window are dropped first, as rate_admit does.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
if #old > 0 then
  local freed = 0
  for _, gone in ipairs(old) do
    freed = freed + tonumber(redis.call('HGET', KEYS[2], gone) or '0')
    redis.call('HDEL', KEYS[2], gone)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  redis.call('HINCRBY', KEYS[2], '~total', -freed)
end
local until_ms = tonumber(redis.call('GET', KEYS[3]) or '0')
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('HGET', KEYS[2], '~total') or '0'),
  math.max(until_ms - now, 0)}
