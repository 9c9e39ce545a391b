-- Extend a singleton lease, only while the caller still owns it (never revive a lost one).
-- KEYS[1] lease (string: owner token)
-- ARGV[1] owner token   ARGV[2] lease ms
-- Returns 1 when extended by ARGV[2] ms from now, 0 when it expired or another owner holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
