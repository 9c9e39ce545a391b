-- Record the outcome of an admitted call.
-- KEYS[1] breaker hash   KEYS[2] probe leases
-- KEYS[3] (optional) the list each transition is pushed onto, with the change itself
-- ARGV[1] 'success'|'failure'|'release'   ARGV[2] token   ARGV[3] threshold
-- ARGV[4] break ms   ARGV[5] provider retry-after ms (0 = none)
-- ARGV[6] (with KEYS[3]) the provider's name, for the pushed entry
-- Returns {state_before, state_after, failures, open_until}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function moved(before, after, failures_now, until_ms)
  if KEYS[3] then
    local n = redis.call('HINCRBY', KEYS[1], 'transitions', 1)
    redis.call('RPUSH', KEYS[3], cjson.encode({
      provider = ARGV[6], before = before, after = after, failures = failures_now,
      openUntil = until_ms, at = now, n = n}))
  end
  return {before, after, failures_now, until_ms}
end
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
    return moved('half_open', 'closed', 0, 0)
  end
  return {state, state, failures, open_until}
end
-- a counted failure
if state == 'closed' then
  failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  if failures >= tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[1], 'state', 'open', 'open_until', reopen_at)
    return moved('closed', 'open', failures, reopen_at)
  end
  return {'closed', 'closed', failures, 0}
end
if state == 'half_open' then
  if is_probe then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[1], 'state', 'open', 'open_until', reopen_at)
    return moved('half_open', 'open', failures, reopen_at)
  end
  return {'half_open', 'half_open', failures, open_until}
end
-- already open: a provider's Retry-After may only push the deadline later
if tonumber(ARGV[5]) > 0 and now + tonumber(ARGV[5]) > open_until then
  open_until = now + tonumber(ARGV[5])
  redis.call('HSET', KEYS[1], 'open_until', open_until)
end
return {'open', 'open', failures, open_until}
