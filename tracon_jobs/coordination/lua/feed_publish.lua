-- KEYS[1]: the run's stream. ARGV: seq, maxlen (approximate), ttl seconds, the
-- notification channel, the run id.
-- The append, its TTL and the notification of listening web processes in one call: one
-- round trip, and the stream never outlives its last event by more than the TTL.
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'seq', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[5])
