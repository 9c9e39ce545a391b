-- Extend the leases of slots this process still holds.
-- KEYS[1] holders   ARGV[1] lease ms   ARGV[2..] tokens. Returns how many were renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local renewed = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
