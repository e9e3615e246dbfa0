-- record.lua: the record's format, put in front of every script (it defines
-- functions only; each script's header states its KEYS and ARGV).
--
-- A record is one string under its key:
--
--   <state><fence>,<instant>,<token>[,<fingerprint>]
--
-- state 'c' (claimed: instant = lease expiry) or 'd' (done: instant =
-- expires-at); fence and instant (Unix ms, by the server's clock) in
-- decimal; token: the claim token of the last winner (hex, no comma);
-- fingerprint: a done record's payload fingerprint, absent when empty (it
-- may contain commas: it is the rest of the value). The key expires (SET
-- ... PXAT) at the record's expires-at: lease expiry + ttl for a claimed
-- record, the instant for a done one; Redis deletes it only once now >
-- expires-at.
--
-- Records written by the earlier format (a hash with fields s, f, l, e, t)
-- are read as the same record; the next write replaces the hash with a
-- string.

-- now returns the server's clock in Unix ms.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- load_record returns the record at key as state, fence, instant, token,
-- fingerprint; state is nil when there is no record.
local function load_record(key)
  local v = redis.pcall('GET', key)
  if not v then
    return nil
  end
  if type(v) == 'table' then
    -- WRONGTYPE: a hash of the earlier format.
    local h = redis.call('HMGET', key, 's', 'f', 'l', 'e', 't')
    if not h[1] then
      return nil
    end
    local at = h[3]
    if h[1] == 'd' then
      at = h[4]
    end
    return h[1], tonumber(h[2]), tonumber(at), h[5] or '', ''
  end
  local s, f, at, t, fp = string.match(v, '^([cd])(%d+),(%d+),([^,]*),?(.*)$')
  if not s then
    return error({err = 'ERR redislock: the value at ' .. key .. ' is not a record'})
  end
  return s, tonumber(f), tonumber(at), t, fp
end

-- save_record writes the record at key, to expire at expires (Unix ms).
local function save_record(key, s, f, at, t, fp, expires)
  local v = s .. string.format('%d,%d,', f, at) .. t
  if fp ~= '' then
    v = v .. ',' .. fp
  end
  redis.call('SET', key, v, 'PXAT', string.format('%d', expires))
end
