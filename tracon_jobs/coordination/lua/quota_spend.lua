-- Add what a tenant spent to the counter of each of its windows (the day's and the month's).
-- KEYS[...] window counters   ARGV[1] cost nanos spent (positive)
-- A counter that does not exist is left alone: the next gate seeds it from SQL, which has
-- this spend. INCRBY is atomic, so concurrent spends of several workers are never lost.
local seen = 0
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('INCRBY', key, ARGV[1])
    seen = seen + 1
  end
end
return seen
