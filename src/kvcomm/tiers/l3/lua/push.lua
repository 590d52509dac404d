
local EMPTY_EXT = '\128'
local FEED, SEQ, INDEX = KEYS[1], KEYS[2], KEYS[3]
local N = #KEYS - 3
local FLAGS, MAXLEN, CHANNEL, HINTS = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local GRACE, XKEY = ARGV[6], ARGV[7]
local INLINE = tonumber(ARGV[5] or '')  -- (none: every record inline, as before)
local P = #FEED + 2  -- where the user key starts in a record key
local stored_n, last_hint, last_seq = 0, nil, nil
-- the record's deadline (epoch seconds: kvcomm.core.expiry), nil when none
local function deadline_of(x)
  if type(x) ~= 'string' or #x == 0 then return nil end
  local ok, m = pcall(cmsgpack.unpack, x)
  if not ok or type(m) ~= 'table' then return nil end
  local d = m.e
  if type(d) ~= 'number' or not (d > 0 and d < 1e300) then return nil end
  return d
end
local MAX_COUNTER = 9007199254740991  -- 2**53-1: every larger integer is a double >= 2**53
local function counter_ok(c)
  return type(c) == 'number' and c >= 1 and c <= MAX_COUNTER
end
-- a record as a table of named fields, or nil when it is not one (fields read by name;
-- a format-1 array is read into the same names); nil, 'newer' for a record of a format
-- newer than this script's
local function read(raw)
  local ok, r = pcall(cmsgpack.unpack, raw)
  if not ok or type(r) ~= 'table' then return nil end
  if r.f == nil and r[1] == 1 and #r == 9 then
    r = {f = 1, h = r[2], d = r[3], t = r[4], m = r[5], v = r[6], vv = r[7],
         dot = {r[8], r[9]}, x = EMPTY_EXT}
  elseif type(r.f) == 'number' and r.f > 2 then
    return nil, 'newer'
  elseif r.f ~= 2 then
    return nil
  end
  if type(r.h) ~= 'string' or #r.h ~= 16 or type(r.d) ~= 'boolean'
     or type(r.t) ~= 'number' or type(r.m) ~= 'string' or type(r.v) ~= 'string'
     or type(r.x) ~= 'string' or type(r.vv) ~= 'table' or type(r.dot) ~= 'table'
     or type(r.dot[1]) ~= 'string' or not counter_ok(r.dot[2]) then
    return nil
  end
  local f = r.vv
  if #f % 2 ~= 0 then return nil end
  for i = 1, #f, 2 do
    if type(f[i]) ~= 'string' or not counter_ok(f[i + 1]) then return nil end
  end
  return r
end
-- a counter's state (kvcomm.core.counter: actor -> {p, n, bp, bn}) from a live counter
-- (tag COUNTER) or a deleted one (a tombstone of meta 'c'); nil for any other record, or
-- a state that is not one (the record then merges as a plain one)
local COUNTER = 5
local function counter_of(r)
  if not ((r.t == COUNTER and not r.d) or (r.d and r.m == 'c')) then return nil end
  local ok, st = pcall(cmsgpack.unpack, r.v)
  if not ok or type(st) ~= 'table' then return nil end
  for k, e in pairs(st) do
    if type(k) ~= 'string' or type(e) ~= 'table' or #e ~= 4 then return nil end
    for j = 1, 4 do
      if type(e[j]) ~= 'number' or e[j] < 0 or e[j] > MAX_COUNTER then return nil end
    end
  end
  return st
end
-- two states merged: the later generation (the entry '': the put a counter adopted)
-- whole; of one generation, actor by actor, the greatest of each number
local NO_GEN = {0, 0, 0, 0}
local function merge_counters(a, b)
  local ga, gb = a[''] or NO_GEN, b[''] or NO_GEN
  for j = 1, 3 do
    if ga[j] > gb[j] then return a elseif ga[j] < gb[j] then return b end
  end
  local out = {}
  for k, e in pairs(a) do out[k] = {e[1], e[2], e[3], e[4]} end
  for k, e in pairs(b) do
    local o = out[k]
    if o == nil then
      out[k] = {e[1], e[2], e[3], e[4]}
    else
      for j = 1, 4 do if e[j] > o[j] then o[j] = e[j] end end
    end
  end
  return out
end
-- whether a counter adopted a put (its generation) stamped at or after the HLC h (a
-- record's 16 hex digits): it was counted after that plain record (kvcomm._client.counters
-- .adopted_since), and wins over it
local function adopted_since(st, h)
  local g = st['']
  if g == nil then return false end
  local hi, lo = tonumber(string.sub(h, 1, 8), 16), tonumber(string.sub(h, 9, 16), 16)
  if hi == nil or lo == nil then return false end
  return g[1] > hi or (g[1] == hi and g[2] >= lo)
end
local function counter_live(st)
  for k, e in pairs(st) do
    if k ~= '' and (e[1] ~= e[3] or e[2] ~= e[4]) then return true end
  end
  return false
end
local function vv(r)
  local t = {}
  local f = r.vv
  for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
  return t
end
-- a value-less entry's version note: 'counter:flags:actor', the record's dot (flags:
-- d = tombstone, m = merged here; the actor last, since a host id may hold ':')
local function note(r, merged)
  local flags = ''
  if r.d then flags = 'd' end
  if merged then flags = flags .. 'm' end
  return string.format('%d', r.dot[2]) .. ':' .. flags .. ':' .. r.dot[1]
end
local function store(rkey, key, bytes, r, merged, prev)
  -- (a script is not rolled back on error: the record goes last, once its feed entry and
  -- its index entry are in)
  local dead = r.d
  -- a record past its deadline is a tombstone at its version: out of the key index
  local d = deadline_of(r.x)
  if d ~= nil then
    local t = redis.call('TIME')
    if d <= tonumber(t[1]) + tonumber(t[2]) / 1e6 then dead = true end
  end
  -- (kvx is touched only by records with a deadline or replacing one: a key named in
  -- ARGV that is not local during a slot migration fails the push, which is retried)
  if XKEY then
    if d ~= nil and not dead then
      redis.call('ZADD', XKEY, d, key)
    elseif d ~= nil or (prev ~= nil and deadline_of(prev.x) ~= nil) then
      redis.call('ZREM', XKEY, key)
    end
  end
  if dead then
    redis.call('ZREM', INDEX, key)
    -- the empty member (no key is empty) keeps the index of a group that was ever written
    -- in existence: a push declaring it during a slot migration then finds it where the
    -- group's other keys are, instead of retrying (TRYAGAIN) until the migration ends
    redis.call('ZADD', INDEX, 0, '')
  else
    redis.call('ZADD', INDEX, 0, key)
  end
  local s = redis.pcall('INCR', SEQ)
  if type(s) ~= 'number' then  -- a foreign value: restart the sequence (readers resync)
    redis.call('DEL', SEQ)
    s = redis.call('INCR', SEQ)
  end
  local hint = s  -- (an inline entry's hint: the group's sequence number; readers XRANGE)
  local id
  if INLINE == nil or #bytes <= INLINE then  -- the record itself (the format-1 entry)
    id = redis.call('XADD', FEED, 'MAXLEN', '~', MAXLEN, '*', 'k', key, 'r', bytes, 's', s)
  else  -- value-less: readers GET the record if they want the key ('q', not 's': a
    -- reader that knows only 's' finds no sequence number and resyncs the group)
    local n = note(r, merged)
    id = redis.call('XADD', FEED, 'MAXLEN', '~', MAXLEN, '*', 'k', key, 'q', s, 'n', n)
    -- the hint carries the whole entry ("seq id note key"): a reader that follows the
    -- group's sequence applies it without reading the stream
    hint = string.format('%d', s) .. ' ' .. id .. ' ' .. n .. ' ' .. key
  end
  redis.call('SET', rkey, bytes)
  if d ~= nil and GRACE then
    -- kept past its deadline as a tombstone for the grace (so that no replayed older
    -- write comes back), then Redis reclaims it; a later write without one clears this
    -- (a deadline past 2**53 ms, some 285,000 years, is given none: Redis refused the
    -- number, after the record was stored, and the push failed every time)
    local at = math.floor(d * 1000) + tonumber(GRACE)
    if at < 9007199254740992 then
      redis.call('PEXPIREAT', rkey, string.format('%.0f', at))
    end
  end
  stored_n, last_hint, last_seq = stored_n + 1, hint, s
  -- the hint: lost hints cost time (the sweep finds the change), never the change itself;
  -- pcall: a server without sharded pub/sub (Redis 6) still stores the record
  if HINTS == 'e' and CHANNEL and CHANNEL ~= '' then
    redis.pcall('SPUBLISH', CHANNEL, hint)
  end
  return s, id
end
-- one record (the i-th): its reply
local function push(i)
  local rkey, bytes = KEYS[3 + i], ARGV[7 + i]
  local key = string.sub(rkey, P)
  local incoming = read(bytes)
  if incoming == nil then
    return redis.error_reply('KVCOMMBAD incoming record is malformed')
  end
  local raw = redis.pcall('GET', rkey)
  if type(raw) == 'table' then raw = '' end  -- another Redis type under the name (WRONGTYPE)
  -- (new, newer: L3 holds the caller's own record, which the reply does not send back)
  if not raw then
    local s, id = store(rkey, key, bytes, incoming, false)
    return {'new', '', s, id}
  end
  local stored, why = read(raw)
  if stored == nil and why == 'newer' then
    return redis.error_reply('KVCOMMCORRUPT stored record has a newer format than this ' ..
                             'host reads; upgrade this host')
  end
  if stored == nil then  -- not a KVCOMM record at all: rewriting the key replaces it
    local s, id = store(rkey, key, bytes, incoming, false)
    return {'new', '', s, id}
  end
  local a, b = vv(incoming), vv(stored)
  local a_ge, b_ge = true, true
  for k, v in pairs(b) do
    local x = a[k] or 0
    if x < v then a_ge = false elseif x > v then b_ge = false end
  end
  for k, v in pairs(a) do
    if b[k] == nil then b_ge = false end
  end
  if a_ge and b_ge then
    -- (the very bytes pushed: not sent back, as for new and newer; a replayed backlog)
    if raw == bytes then return {'equal', ''} end
    return {'equal', raw}
  end
  if a_ge then
    local s, id = store(rkey, key, bytes, incoming, false, stored)
    return {'newer', '', s, id}
  end
  if b_ge then return {'older', raw} end
  -- concurrent counters (kvcomm.core.counter) merge here, before any resolver
  local cs, ci = counter_of(stored), counter_of(incoming)
  if (cs == nil and ci == nil) and string.sub(FLAGS, i, i) == 's' then
    return {'conflict', raw}
  end
  -- concurrent: last writer wins by (hlc, dot actor, dot counter); vectors merged
  local win = stored
  if incoming.h > stored.h or (incoming.h == stored.h and (incoming.dot[1] > stored.dot[1]
     or (incoming.dot[1] == stored.dot[1] and incoming.dot[2] > stored.dot[2]))) then
    win = incoming
  end
  local counted = nil
  if cs ~= nil and ci ~= nil then
    counted = merge_counters(cs, ci)
  elseif cs ~= nil then
    -- a plain record (a put, a delete without a state) resets a counter, unless the
    -- counter adopted a put stamped at or after it
    if adopted_since(cs, incoming.h) then win = stored else win = incoming end
  elseif ci ~= nil then
    if adopted_since(ci, stored.h) then win = incoming else win = stored end
  end
  local merged = {}
  for k, v in pairs(b) do merged[k] = v end
  for k, v in pairs(a) do if (merged[k] or 0) < v then merged[k] = v end end
  local actors = {}
  for k, _ in pairs(merged) do actors[#actors + 1] = k end
  table.sort(actors)
  local flat = {}
  for _, k in ipairs(actors) do flat[#flat + 1] = k; flat[#flat + 1] = merged[k] end
  -- the winner's fields by name, in format 2; its extension copied as the bytes it was
  local out = {f = 2, h = win.h, d = win.d, t = win.t, m = win.m, v = win.v, vv = flat,
               dot = {win.dot[1], win.dot[2]}, x = win.x}
  if counted ~= nil then  -- the merged state: a counter, or a deleted one if nothing counts
    out.v = cmsgpack.pack(counted)
    if counter_live(counted) then
      out.d, out.t, out.m = false, COUNTER, ''
    else
      out.d, out.t, out.m = true, 0, 'c'
    end
  end
  local packed = cmsgpack.pack(out)
  local s, id = store(rkey, key, packed, out, true, stored)
  return {'merged', packed, s, id}
end
local replies = {}
-- the bytes of records the replies carry back (each read into Lua): past the budget the
-- call's remaining records are left for another call (their reply says so)
local BUDGET, out_bytes = tonumber(ARGV[8 + N] or ''), 0
for i = 1, N do
  if BUDGET ~= nil and out_bytes >= BUDGET then
    replies[i] = redis.error_reply('KVCOMMLATER the call\'s reply budget is spent: send again')
  else
    -- a Redis error while one record is stored (a foreign type under the group's stream,
    -- say) is that record's reply; the next records are pushed as if called one by one
    local ok, reply = pcall(push, i)
    if not ok then
      if type(reply) == 'table' and reply.err then
        reply = redis.error_reply(reply.err)
      else
        reply = redis.error_reply(tostring(reply))
      end
    end
    if type(reply) == 'table' and type(reply[2]) == 'string' then
      out_bytes = out_bytes + #reply[2]
    end
    replies[i] = reply
  end
end
-- one hint for the call ("l"): the change itself when it is the only one, else the
-- group's sequence number (also when nothing was stored: an earlier call's changes)
if HINTS == 'l' and CHANNEL and CHANNEL ~= '' then
  if stored_n == 1 then
    redis.pcall('SPUBLISH', CHANNEL, last_hint)
  elseif last_seq ~= nil then
    redis.pcall('SPUBLISH', CHANNEL, string.format('%d', last_seq))
  else
    local s = redis.pcall('GET', SEQ)
    if type(s) ~= 'string' then s = '0' end
    redis.pcall('SPUBLISH', CHANNEL, s)
  end
end
return replies
