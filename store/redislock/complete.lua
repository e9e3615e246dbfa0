-- complete.lua: mark a claimed record done if the caller's claim is current.
-- Runs after complete_fast.lua (the path of a record that is still exactly
-- the caller's claim, which sets v, the GET's reply) and record.lua (the
-- format and its functions).
--
-- KEYS[1]  the record's Redis key
-- ARGV[1]  the caller's claimed record as its claim wrote it (or as its
--          last extend rewrote it): c<fence>,<lease expiry>,<token>
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  the done record to write for that same claim (same fence and
--          token): d<fence>,,<token>, then ,<fingerprint> when the payload
--          fingerprint to store is not empty; the backend sends no
--          token with a comma and no fence below 1 (no record has one:
--          it answers false itself), so the token ends at the first comma
--          after ',,'
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
-- A record equal to ARGV[1] is completed by complete_fast.lua. Any other
-- (the lease moved by an extend the caller did not see, a done record, a
-- record of the earlier format, another claim's) is decoded here and
-- compared by fence and token, which ARGV[3] carries.
--
-- A done record expires at completion time + ttl, by the server's clock
-- (SET ... PX ttl): two commands, GET and SET.
local cf, ct = string.match(ARGV[3], '^d(%d+),,([^,]*)')
if not cf then
  return error({err = 'ERR redislock: ARGV[3] is not a done record'})
end
local s, f, _, t = decode(KEYS[1], v)
if not s or f ~= tonumber(cf) or t ~= ct then
  return 0
end
if s == 'd' then
  return 1
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
return 1
