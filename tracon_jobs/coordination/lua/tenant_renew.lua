-- A running run of a tenant keeps its place for another lease (a place that lapsed is not
-- taken back: the run goes on, and its place is counted again from its next admission).
-- KEYS[1] running (zset run id -> lease deadline ms)   ARGV[1] run id   ARGV[2] lease ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
