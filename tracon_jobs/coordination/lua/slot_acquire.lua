-- Take a provider concurrency slot, first come first served, or join the queue for one.
-- KEYS[1] holders (zset token -> lease deadline ms)   KEYS[2] queue (zset token -> ticket)
-- KEYS[3] waiters (zset token -> waiter deadline ms) KEYS[4] ticket counter
-- ARGV[1] token   ARGV[2] limit   ARGV[3] lease ms   ARGV[4] waiter lease ms
-- Returns 1 when the slot is held, 0 while waiting.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = ARGV[1]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)  -- holders that crashed
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)  -- waiters that crashed
for _, dead in ipairs(gone) do
  redis.call('ZREM', KEYS[2], dead)
  redis.call('ZREM', KEYS[3], dead)
end
if redis.call('ZSCORE', KEYS[1], token) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), token)
  return 1
end
if not redis.call('ZSCORE', KEYS[2], token) then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), token)
end
local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
if free > 0 and redis.call('ZRANK', KEYS[2], token) < free then
  redis.call('ZREM', KEYS[2], token)
  redis.call('ZREM', KEYS[3], token)
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), token)
  return 1
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), token)
return 0
