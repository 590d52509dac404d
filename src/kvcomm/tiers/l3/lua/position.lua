
local s = tonumber(redis.call('GET', KEYS[2]) or '0') or -1
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then return {s, '0-0'} end
return {s, last[1][1]}
