#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
local limit = tonumber(ARGV[3])
for i = 4, #ARGV do
  local r = redis.pcall('ZRANGEBYLEX', ARGV[i], ARGV[1], ARGV[2], 'LIMIT', 0, limit)
  if type(r) == 'table' and r.err then out[i - 3] = 'ERR ' .. r.err else out[i - 3] = r end
end
return out
