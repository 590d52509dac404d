
local raw = redis.pcall('GET', KEYS[1])
local live = false
if type(raw) == 'string' then
  local ok, r = pcall(cmsgpack.unpack, raw)
  if ok and type(r) == 'table' then
    if r.f == nil and r[1] == 1 then live = r[3] == false else live = r.d == false end
  end
end
if live then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[2], 0, '')
end
return live and 1 or 0
