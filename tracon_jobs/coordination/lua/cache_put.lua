-- Store one cached model response, bounded per cache: the oldest entries go first.
-- KEYS[1] entry key   KEYS[2] the cache's index (sorted set: entry key -> stored at, ms)
-- ARGV[1] the response (JSON)   ARGV[2] ttl ms   ARGV[3] max entries
-- Returns how many older entries were evicted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)  -- expired entries leave the index
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess <= 0 then
  redis.call('PEXPIRE', KEYS[2], ttl)
  return 0
end
local oldest = redis.call('ZPOPMIN', KEYS[2], excess)
for i = 1, #oldest, 2 do
  redis.call('DEL', oldest[i])
end
redis.call('PEXPIRE', KEYS[2], ttl)
return excess
