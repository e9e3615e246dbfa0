-- complete.lua: mark a claimed record done if the caller's claim is current.
--
-- KEYS[1]  the record's Redis key (a hash; fields as in claim.lua)
-- ARGV[1]  the caller's fence
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  the caller's claim token
--
-- Returns 1 if the record is done with that fence and token afterwards
-- (completing a done record again changes nothing, so a resend after a lost
-- reply, with the same ARGV, finds its own completion), 0 if the fence is
-- stale, the token is another claim's, or the record is gone. There is no
-- lease test: the fence decides ownership. The token only tells apart a
-- record created afresh after this claim's record was reaped, whose fence
-- restarted at 1 and may equal the caller's.
--
-- A done record expires at completion time + ttl, by the server's clock.
local r = redis.call('HMGET', KEYS[1], 's', 'f', 't')
if not r[1] or tonumber(r[2]) ~= tonumber(ARGV[1]) or r[3] ~= ARGV[3] then
  return 0
end
if r[1] == 'd' then
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 's', 'd', 'e', expires)
redis.call('PEXPIREAT', KEYS[1], expires)
return 1
