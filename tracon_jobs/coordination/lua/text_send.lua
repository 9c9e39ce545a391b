-- KEYS: the runs' turn texts (hashes: call, text), one an op. ARGV[1]: the delta channel,
-- ARGV[2]: the texts' TTL in seconds; then four an op: what ('a': add its text, 'x':
-- withdraw the call's text, 'f': forget it), the call's seq, the run id, the text ('' but
-- for 'a').
-- Each op in order, as if alone: an append updates the text and its TTL and publishes the
-- delta with its offset (the bytes before it); a withdrawal deletes the text and publishes
-- that; forgetting only deletes it. A later call of a run replaces its text; an op of an
-- earlier call (a writer that lost the run) changes nothing. Returns the ops applied.
local applied = 0
for i = 1, #KEYS do
  local at = 2 + (i - 1) * 4
  local what, call, run = ARGV[at + 1], tonumber(ARGV[at + 2]), ARGV[at + 3]
  local found = redis.call('HMGET', KEYS[i], 'call', 'text')
  local held = tonumber(found[1] or '0')
  if held <= call then
    applied = applied + 1
    if what == 'a' then
      local before = ''
      if held == call then before = found[2] or '' end
      local text = ARGV[at + 4]
      redis.call('HSET', KEYS[i], 'call', ARGV[at + 2], 'text', before .. text)
      redis.call('EXPIRE', KEYS[i], ARGV[2])
      redis.call('PUBLISH', ARGV[1], cjson.encode({r = run, c = call, o = #before, t = text}))
    else
      redis.call('DEL', KEYS[i])
      if what == 'x' then
        redis.call('PUBLISH', ARGV[1], cjson.encode({r = run, c = call, x = 1}))
      end
    end
  end
end
return applied
