-- record.lua: the record's format, put in front of every script (it defines
-- functions only; each script's header states its KEYS and ARGV); behind
-- claim_fresh.lua and complete_fast.lua, the common paths that need none.
--
-- A record is one string under its key:
--
--   claimed  c<fence>,<lease expiry>,<token>
--   done     d<fence>,,<token>[,<fingerprint>]
--
-- fence and lease expiry (Unix ms, by the server's clock) in decimal;
-- token: the claim token of the last winner (hex, no comma); fingerprint:
-- a done record's payload fingerprint, absent when empty (it may contain
-- commas: it is the rest of the value). The key expires at the record's
-- expires-at, which for a done record is not stored in the value: it is
-- the key's own expiry (PEXPIRETIME), set by SET ... PX ttl when the record
-- was completed. A claimed key expires at lease expiry + ttl (SET ...
-- PXAT). Redis deletes a key only once now > its expiry.
--
-- Records written by the earlier format (a hash with fields s, f, l, e, t,
-- the key expiring at e) are read as the same record; the next write
-- replaces the hash with a string.

-- now returns the server's clock in Unix ms.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- decode reads v, the reply of a GET (or SET ... GET) of key, as state,
-- fence, lease expiry (claimed records only; nil for done ones, whose
-- expires-at is the key's expiry), token, fingerprint; state is nil when
-- there is no record.
local function decode(key, v)
  if not v then
    return nil
  end
  if type(v) == 'table' then
    if not string.find(v.err or '', 'WRONGTYPE', 1, true) then
      error(v)
    end
    -- A hash of the earlier format.
    local h = redis.call('HMGET', key, 's', 'f', 'l', 't')
    if not h[1] then
      return nil
    end
    local lease = nil
    if h[1] == 'c' then
      lease = tonumber(h[3])
    end
    return h[1], tonumber(h[2]), lease, h[4] or '', ''
  end
  local s, f, at, t, fp = string.match(v, '^([cd])(%d+),(%d*),([^,]*),?(.*)$')
  if not s then
    return error({err = 'ERR redislock: the value at ' .. key .. ' is not a record'})
  end
  return s, tonumber(f), tonumber(at), t, fp
end

-- load_record returns the record at key as decode does.
local function load_record(key)
  return decode(key, redis.pcall('GET', key))
end

-- claimed_value is the value of a claimed record.
local function claimed_value(f, lease, t)
  return string.format('c%d,%d,', f, lease) .. t
end

-- save_claimed writes a claimed record at key, to expire at expires (Unix
-- ms).
local function save_claimed(key, f, lease, t, expires)
  redis.call('SET', key, claimed_value(f, lease, t), 'PXAT', string.format('%d', expires))
end
