-- Take a singleton lease, or extend it when this owner already holds it.
-- KEYS[1] lease (string: owner token, expires by PX on Redis server time)
-- ARGV[1] owner token   ARGV[2] lease ms
-- Returns 1 when ARGV[1] holds the lease for ARGV[2] ms from now, 0 when another owner does.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
