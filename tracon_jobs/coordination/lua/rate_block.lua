-- The provider said when it takes calls again (Retry-After, a rate-limit reset): no call
-- starts before then, on any worker. A later time wins; an earlier one is ignored.
-- KEYS[1] the provider's block (ms)   ARGV[1] ms from now
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[1])
if until_ms > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], until_ms, 'PX', tonumber(ARGV[1]) + 1000)
  return 1
end
return 0
