
local CAS_MODE, CAS_CHECK, CAS_BASIS = ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
for _ = 1, 3 do ARGV[#ARGV] = nil end
local function cas_vv(flat)
  if type(flat) ~= 'table' or #flat % 2 ~= 0 then return nil end
  local t = {}
  for i = 1, #flat, 2 do
    if type(flat[i]) ~= 'string' or type(flat[i + 1]) ~= 'number' then return nil end
    t[flat[i]] = flat[i + 1]
  end
  return t
end
local function cas_le(a, b)
  for k, v in pairs(a) do if (b[k] or 0) < v then return false end end
  return true
end
local cas_ok1, cas_check = pcall(cmsgpack.unpack, CAS_CHECK or '')
local cas_ok2, cas_basis = pcall(cmsgpack.unpack, CAS_BASIS or '')
cas_check, cas_basis = cas_vv(cas_check), cas_vv(cas_basis)
if not (cas_ok1 and cas_ok2) or cas_check == nil or cas_basis == nil
   or (CAS_MODE ~= 'a' and CAS_MODE ~= 'v') then
  return {redis.error_reply('KVCOMMBAD the expectation of a conditional write is malformed')}
end
local cas_raw = redis.pcall('GET', KEYS[#KEYS])
local cas_s, cas_dead = nil, false
if type(cas_raw) == 'string' then
  local ok, r = pcall(cmsgpack.unpack, cas_raw)
  if ok and type(r) == 'table' then
    if r.f == nil and r[1] == 1 and #r == 9 then
      r = {f = 1, vv = r[7], d = r[3], x = ''}
    elseif type(r.f) == 'number' and r.f > 2 then
      return {redis.error_reply('KVCOMMCORRUPT stored record has a newer format than this ' ..
                                'host reads; upgrade this host')}
    end
    if r.f == 1 or r.f == 2 then cas_s = cas_vv(r.vv) end
    if cas_s ~= nil then
      cas_dead = r.d == true
      if not cas_dead and type(r.x) == 'string' and #r.x > 0 then
        local okx, m = pcall(cmsgpack.unpack, r.x)
        if okx and type(m) == 'table' and type(m.e) == 'number' and m.e > 0 and m.e < 1e300 then
          local t = redis.call('TIME')
          if m.e <= tonumber(t[1]) + tonumber(t[2]) / 1e6 then cas_dead = true end
        end
      end
    end
  end
else
  cas_raw = ''  -- (none; or another Redis type, which the push replaces as it would)
end
if cas_s ~= nil then
  local pass
  if CAS_MODE == 'a' then
    pass = cas_dead or cas_le(cas_s, cas_check)
  else
    pass = cas_le(cas_s, cas_check) and not (cas_dead and cas_le(cas_check, cas_s))
  end
  if not pass then return {{'conflict', cas_raw}} end
  if not cas_le(cas_s, cas_basis) then return {{'stale', cas_raw}} end
end
