-- Open a tree's budget once, seeded from SQL (so a flushed Redis rebuilds it).
-- KEYS[1] budget hash   ARGV[1] tokens  ARGV[2] cost nanos  ARGV[3] children
-- ARGV[4] unknown price '0'|'1'  ARGV[5] ms the tree already executed  ARGV[6] ttl ms
-- Returns 1 when this call opened it.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[6]))
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'tokens', ARGV[1], 'reserved', 0, 'cost_nanos', ARGV[2],
  'children', ARGV[3], 'unknown_price', ARGV[4], 'started_ms', now - tonumber(ARGV[5]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[6]))
return 1
