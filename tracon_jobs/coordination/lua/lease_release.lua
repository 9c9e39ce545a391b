-- Give a singleton lease back, only when the caller owns it (a late release by a process
-- whose lease expired must not delete the new owner's lease).
-- KEYS[1] lease (string: owner token)
-- ARGV[1] owner token
-- Returns 1 when deleted, 0 when the caller did not own it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
