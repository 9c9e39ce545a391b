-- Move a tree's start later by the time it waited for a person (MaxDuration excludes it).
-- KEYS[1] budget hash   ARGV[1] ms waited
-- Returns 1 when the tree's budget exists (a lost one is rebuilt from SQL, wait included).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'started_ms', tonumber(ARGV[1]))
return 1
