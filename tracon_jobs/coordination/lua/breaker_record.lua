-- Record the outcome of an admitted call.
-- KEYS[1] breaker hash   KEYS[2] probe leases
-- ARGV[1] 'success'|'failure'|'release'   ARGV[2] token   ARGV[3] threshold
-- ARGV[4] break ms   ARGV[5] provider retry-after ms (0 = none)
-- Returns {state_before, state_after, failures, open_until}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HGET', KEYS[1], 'state') or 'closed'
local failures = tonumber(redis.call('HGET', KEYS[1], 'failures') or '0')
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
local outcome, token = ARGV[1], ARGV[2]
local is_probe = redis.call('ZSCORE', KEYS[2], token)
local reopen_at = now + math.max(tonumber(ARGV[4]), tonumber(ARGV[5]))

if outcome == 'release' then
  redis.call('ZREM', KEYS[2], token)
  return {state, state, failures, open_until}
end
if outcome == 'success' then
  if state == 'closed' then
    if failures ~= 0 then redis.call('HSET', KEYS[1], 'failures', 0) end
    return {'closed', 'closed', 0, 0}
  end
  if state == 'half_open' and is_probe then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[1], 'state', 'closed', 'failures', 0, 'open_until', 0)
    return {'half_open', 'closed', 0, 0}
  end
  return {state, state, failures, open_until}
end
-- a counted failure
if state == 'closed' then
  failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  if failures >= tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[1], 'state', 'open', 'open_until', reopen_at)
    return {'closed', 'open', failures, reopen_at}
  end
  return {'closed', 'closed', failures, 0}
end
if state == 'half_open' then
  if is_probe then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[1], 'state', 'open', 'open_until', reopen_at)
    return {'half_open', 'open', failures, reopen_at}
  end
  return {'half_open', 'half_open', failures, open_until}
end
-- already open: a provider's Retry-After may only push the deadline later
if tonumber(ARGV[5]) > 0 and now + tonumber(ARGV[5]) > open_until then
  open_until = now + tonumber(ARGV[5])
  redis.call('HSET', KEYS[1], 'open_until', open_until)
end
return {'open', 'open', failures, open_until}
