-- A call's tokens as its answer counted them, in place of what its start reserved, under
-- each of its limits. KEYS, two a limit: starts (zset), tokens (hash, with '~total')
-- ARGV[1] call id   ARGV[2] the tokens the answer used
-- A start already out of the window is left alone (it counts no more).
local used = tonumber(ARGV[2])
for k = 1, #KEYS, 2 do
  if redis.call('ZSCORE', KEYS[k], ARGV[1]) then
    local before = tonumber(redis.call('HGET', KEYS[k + 1], ARGV[1]) or '0')
    redis.call('HSET', KEYS[k + 1], ARGV[1], used)
    redis.call('HINCRBY', KEYS[k + 1], '~total', used - before)
  end
end
return 1
