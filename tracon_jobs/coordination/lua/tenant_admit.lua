-- A tenant's run may execute now (1), or waits its turn behind the tenant's others (0).
-- KEYS[1] running (zset run id -> lease deadline ms)   KEYS[2] waiting (zset run id -> ticket)
-- KEYS[3] ticket counter
-- ARGV[1] run id   ARGV[2] the tenant's most runs at once   ARGV[3] lease ms
-- A run given a place by `tenant_release` finds it held for it; a place whose run's process
-- died frees itself when its lease ends. Waiting runs keep their order (first come first).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local run, limit, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], run) then
  redis.call('ZADD', KEYS[1], now + lease, run)
  return 1
end
local ahead = redis.call('ZRANK', KEYS[2], run) or redis.call('ZCARD', KEYS[2])
if redis.call('ZCARD', KEYS[1]) + ahead < limit then  -- a place, none of it owed to another
  redis.call('ZREM', KEYS[2], run)
  redis.call('ZADD', KEYS[1], now + lease, run)
  redis.call('PEXPIRE', KEYS[1], lease * 2)
  return 1
end
if not redis.call('ZSCORE', KEYS[2], run) then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), run)
end
redis.call('PEXPIRE', KEYS[2], lease * 6)
redis.call('PEXPIRE', KEYS[3], lease * 6)
return 0
