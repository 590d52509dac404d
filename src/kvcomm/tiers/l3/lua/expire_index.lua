#!lua flags=allow-cross-slot-keys
local n = 0
for i = 3, #ARGV, 2 do
  local due = redis.pcall('ZRANGEBYSCORE', ARGV[i], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
  if type(due) == 'table' and not due.err then
    for _, k in ipairs(due) do
      redis.call('ZREM', ARGV[i + 1], k)
      redis.call('ZREM', ARGV[i], k)
      n = n + 1
    end
  end
end
return n
