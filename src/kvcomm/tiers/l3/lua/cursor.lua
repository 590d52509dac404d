#!lua flags=no-writes
local at = redis.call('XREVRANGE', KEYS[1], ARGV[1], '-', 'COUNT', 1)
if #at == 1 and at[1][1] ~= ARGV[1] then return 1 end
return 0
