-- claim_fresh.lua: the first part of claim.lua (see its header for KEYS,
-- ARGV and the reply), put in front of record.lua: a claim of a key that
-- has no record, what most deliveries run, returns here, before record.lua
-- defines its functions (which Redis would otherwise build on every call).
-- It leaves n (the server's now, ms), lease, expires and old (the record
-- that SET NX ... GET found) to claim.lua; all nil for a resend.
--
-- Redis spends more on a script's own Lua than on its two commands here:
-- the value and the key's expiry are written with string.format('%d'),
-- an integer conversion (Lua's own number-to-string and redis.call's, for
-- a number argument, both format a double, at three times the cost), and
-- a fresh win is answered with one integer.
local n, lease, expires, old
if ARGV[4] ~= 'resend' then
  local t = redis.call('TIME')
  n = t[1] * 1000 + math.floor(t[2] / 1000)
  lease = n + ARGV[1]
  expires = lease + ARGV[2]
  -- %d is exact for every integer up to 2^53 (Lua's numbers are doubles).
  old = redis.pcall('SET', KEYS[1], string.format('c1,%d,%s', lease, ARGV[3]), 'NX', 'PXAT', string.format('%d', expires), 'GET')
  if not old then
    return lease
  end
end
