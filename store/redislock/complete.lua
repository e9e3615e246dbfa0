-- complete.lua: mark a claimed record done if the caller's claim is current.
-- Runs after complete_fast.lua (a string record's path, which sets v, the
-- record's value) and record.lua (the format and its functions).
--
-- KEYS[1]  the record's Redis key
-- ARGV[1]  the caller's fence
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  the caller's claim token
-- ARGV[4]  the payload fingerprint to store ('' for none)
--
-- Returns 1 if the record is done with that fence and token afterwards
-- (completing a done record again changes nothing, its fingerprint and
-- expiry included, so a resend after a lost reply, with the same ARGV,
-- finds its own completion), 0 if the fence is stale, the token is another
-- claim's, or the record is gone. There is no lease test: the fence decides
-- ownership. The token only tells apart a record created afresh after this
-- claim's record was reaped, whose fence restarted at 1 and may equal the
-- caller's.
--
-- A done record expires at completion time + ttl, by the server's clock
-- (SET ... PX ttl): two commands, GET and SET.
local s, f, _, t = decode(KEYS[1], v)
if not s or f ~= tonumber(ARGV[1]) or t ~= ARGV[3] then
  return 0
end
if s == 'd' then
  return 1
end
save_done(KEYS[1], f, t, ARGV[4], ARGV[2])
return 1
