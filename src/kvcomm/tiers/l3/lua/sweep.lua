#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
local tails = ARGV[1] == '1'
for t in string.gmatch(ARGV[2], '%S+') do
  local r = redis.pcall('GET', 'kvs:{' .. t .. '}')
  local f
  if type(r) == 'table' then f = 'E'
  elseif not r then f = ''
  elseif #r < 20 and string.match(r, '^%d+$') then f = r
  else f = '?' end
  if tails and f ~= 'E' then
    local x = redis.pcall('XREVRANGE', 'kvf:{' .. t .. '}', '+', '-', 'COUNT', 1)
    if type(x) == 'table' and not x.err and #x == 1 then f = f .. ' ' .. x[1][1] end
  end
  out[#out + 1] = f
end
return table.concat(out, ',')
