-- claim_fresh.lua: the first part of claim.lua (see its header for KEYS,
-- ARGV and the reply), put in front of record.lua: a claim of a key that
-- has no record, what most deliveries run, returns here, before record.lua
-- defines its functions (which Redis would otherwise build on every call).
-- It leaves n (the server's now, ms), lease, expires and old (the record
-- that SET NX ... GET found) to claim.lua; all nil for a resend.
--
-- Redis spends more on a script's own Lua than on its two commands here,
-- so it converts no number with tonumber or string.format that it can
-- leave to Lua's arithmetic on strings and to redis.call (which writes a
-- number with 17 significant digits: exact for every integer up to 2^53),
-- and answers with one integer.
local n, lease, expires, old
if ARGV[4] ~= 'resend' then
  local t = redis.call('TIME')
  n = t[1] * 1000 + math.floor(t[2] / 1000)
  lease = n + ARGV[1]
  expires = lease + ARGV[2]
  -- Lua writes a number below 10^14 in full ('%.14g').
  local v
  if lease < 1e14 then
    v = 'c1,' .. lease .. ',' .. ARGV[3]
  else
    v = string.format('c%d,%d,', 1, lease) .. ARGV[3]
  end
  old = redis.pcall('SET', KEYS[1], v, 'NX', 'PXAT', expires, 'GET')
  if not old then
    return lease
  end
end
