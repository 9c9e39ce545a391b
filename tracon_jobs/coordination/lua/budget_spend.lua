-- Record what a model call (or a tool) spent, releasing its reservation.
-- KEYS[1] budget hash   ARGV[1] reserved tokens to release   ARGV[2] tokens spent
-- ARGV[3] cost nanos spent   ARGV[4] '1' when the price was unknown
redis.call('HINCRBY', KEYS[1], 'reserved', -tonumber(ARGV[1]))
redis.call('HINCRBY', KEYS[1], 'tokens', tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[1], 'cost_nanos', tonumber(ARGV[3]))
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'unknown_price', '1') end
return redis.call('HGET', KEYS[1], 'tokens')
