-- KEYS[1]: the run's turn text (a hash: call, text). ARGV: the call's seq, the text to add,
-- ttl seconds, the delta channel, the run id.
-- The append, its TTL and the delta's publication in one call. A later call of the run
-- replaces the text; an earlier one (a writer that lost the run) changes nothing.
local held = tonumber(redis.call('HGET', KEYS[1], 'call') or '0')
local call = tonumber(ARGV[1])
if held > call then return -1 end
local before = ''
if held == call then before = redis.call('HGET', KEYS[1], 'text') or '' end
redis.call('HSET', KEYS[1], 'call', ARGV[1], 'text', before .. ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[4], cjson.encode({r = ARGV[5], c = call, o = #before, t = ARGV[2]}))
return #before
