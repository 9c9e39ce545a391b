-- Give a slot back, or leave the queue. KEYS[1] holders  KEYS[2] queue  KEYS[3] waiters
-- ARGV[1] token. Returns 1 when the token held a slot.
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
