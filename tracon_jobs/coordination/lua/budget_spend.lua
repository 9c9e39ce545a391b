-- Record what a model call (or a tool) spent, releasing its reservation.
-- KEYS[1] budget hash   ARGV[1] reservation change (zero or negative)   ARGV[2] tokens spent
-- ARGV[3] cost nanos spent   ARGV[4] '1' when the price was unknown
-- Integers stay strings end to end: a Lua number would print large values as 1e+15.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false  -- lost: the next gate re-seeds it from SQL, which has this spend
end
redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'cost_nanos', ARGV[3])
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'unknown_price', '1') end
return redis.call('HGET', KEYS[1], 'tokens')
