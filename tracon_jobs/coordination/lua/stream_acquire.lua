-- Hold one of a tenant's live-stream places, or say there is none.
-- KEYS[1] holders (zset stream id -> lease deadline ms)
-- ARGV[1] stream id   ARGV[2] limit   ARGV[3] lease ms
-- Returns 1 when held, 0 when the tenant holds `limit` streams already.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)  -- places of processes that died
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
