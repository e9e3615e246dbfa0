-- release.lua: give up a claim: end its lease now and raise the fence.
--
-- KEYS[1]  the record's Redis key (a hash; fields as in claim.lua)
-- ARGV[1]  the caller's fence
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  the caller's claim token (see complete.lua)
--
-- Returns 1 if the claim was released, 0 if there was nothing to release
-- (stale fence, done record, no record, a record created afresh). A resend
-- after a lost reply, with the same ARGV, finds the fence it raised and
-- returns 0. The record is never deleted: a fresh record would restart the
-- fence at 1. It expires at the release time + ttl, as a lease that lapsed
-- then would.
local r = redis.call('HMGET', KEYS[1], 's', 'f', 't')
if r[1] ~= 'c' or tonumber(r[2]) ~= tonumber(ARGV[1]) or r[3] ~= ARGV[3] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'f', tonumber(r[2]) + 1, 'l', now, 'e', expires)
redis.call('PEXPIREAT', KEYS[1], expires)
return 1
