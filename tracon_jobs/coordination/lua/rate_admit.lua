-- Admit one call start under sliding-window rate limits (a provider's, its model's), or
-- say how long to wait: the start is recorded under every limit, or under none.
-- KEYS, three a limit: starts (zset call id -> start ms), tokens (hash call id -> tokens,
--   and '~total' -> their sum), the provider's own word (no start before this ms)
-- ARGV[1] call id   ARGV[2] the call's tokens (its input and the output it may write)
-- ARGV[3] window ms; then two a limit: requests a window, tokens a window (-1: none)
-- Returns {0, now ms} when admitted, else {ms to wait, now ms}. Exact: no more than the
-- requests, and no more than the tokens, of starts in any window of ARGV[3] ms (a call whose
-- tokens alone exceed a token limit starts on an empty window).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, need, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

local function wait_under(starts, tokens, blocked, max_requests, max_tokens)
  local until_ms = tonumber(redis.call('GET', blocked) or '0')
  if until_ms > now then return until_ms - now end
  local old = redis.call('ZRANGEBYSCORE', starts, '-inf', now - window)
  if #old > 0 then
    local freed = 0
    for _, gone in ipairs(old) do
      freed = freed + tonumber(redis.call('HGET', tokens, gone) or '0')
      redis.call('HDEL', tokens, gone)
    end
    redis.call('ZREMRANGEBYSCORE', starts, '-inf', now - window)
    redis.call('HINCRBY', tokens, '~total', -freed)
  end
  local count = redis.call('ZCARD', starts)
  if max_requests >= 0 and count >= max_requests then
    if max_requests == 0 then return window end
    local first = redis.call('ZRANGE', starts, count - max_requests, count - max_requests,
      'WITHSCORES')
    return math.max(tonumber(first[2]) + window - now, 1)
  end
  if max_tokens >= 0 and count > 0 then
    local total = tonumber(redis.call('HGET', tokens, '~total') or '0')
    if total + need > max_tokens then
      -- the oldest starts whose tokens make room go first (all of them, for a call whose
      -- own tokens exceed the limit: it starts on an empty window)
      local room = total + need - max_tokens
      local entries = redis.call('ZRANGE', starts, 0, -1, 'WITHSCORES')
      for i = 1, #entries, 2 do
        room = room - tonumber(redis.call('HGET', tokens, entries[i]) or '0')
        if room <= 0 or i + 1 == #entries then
          return math.max(tonumber(entries[i + 1]) + window - now, 1)
        end
      end
    end
  end
  return 0
end

local wait = 0
for k = 1, #KEYS, 3 do
  local at = 4 + (k - 1) / 3 * 2
  local w = wait_under(KEYS[k], KEYS[k + 1], KEYS[k + 2], tonumber(ARGV[at]),
    tonumber(ARGV[at + 1]))
  if w > wait then wait = w end
end
if wait > 0 then return {wait, now} end
for k = 1, #KEYS, 3 do
  redis.call('ZADD', KEYS[k], now, id)
  redis.call('HSET', KEYS[k + 1], id, need)
  redis.call('HINCRBY', KEYS[k + 1], '~total', need)
  redis.call('PEXPIRE', KEYS[k], window * 2)
  redis.call('PEXPIRE', KEYS[k + 1], window * 2)
end
return {0, now}
