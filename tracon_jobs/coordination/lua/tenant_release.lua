-- A tenant's run ended (or let go of its place): the places it frees go to the runs that
-- waited longest, held for them (their lease running), and their ids come back to be sent.
-- KEYS[1] running (zset)   KEYS[2] waiting (zset)   ARGV[1] run id (or '' for none)
-- ARGV[2] the tenant's most runs at once   ARGV[3] lease ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
local given = {}
while redis.call('ZCARD', KEYS[1]) < limit do
  local next = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not next then break end
  redis.call('ZREM', KEYS[2], next)
  redis.call('ZADD', KEYS[1], now + lease, next)
  given[#given + 1] = next
end
return given
