-- Check a tenant's cost quota for one period window before work starts.
-- KEYS[1] the window's counter (cost nanos spent by the tenant in the window)
-- ARGV[1] limit nanos   ARGV[2] nanos the caller spent that the counter has not seen yet
-- Returns {'' allowed | 'CostLimit' refused | '?' counter gone, used nanos as a string}.
-- The counter is a string end to end: a Lua number would print large values as 1e+15.
local used = redis.call('GET', KEYS[1])
if not used then
  return {'?', '0'}  -- never seeded, or lost (a flushed Redis): the caller seeds it from SQL
end
if tonumber(used) + tonumber(ARGV[2]) >= tonumber(ARGV[1]) then
  return {'CostLimit', used}
end
return {'', used}
