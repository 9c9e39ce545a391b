-- KEYS[1]: the run's turn text. ARGV: the call's seq, the delta channel, the run id, and
-- whether to publish ('1': the call's partial text is withdrawn) or only forget ('0': the
-- call completed and its text is in its ModelCallCompleted).
local held = tonumber(redis.call('HGET', KEYS[1], 'call') or '0')
local call = tonumber(ARGV[1])
if held > call then return 0 end
redis.call('DEL', KEYS[1])
if ARGV[4] == '1' then
  redis.call('PUBLISH', ARGV[2], cjson.encode({r = ARGV[3], c = call, x = 1}))
end
return 1
