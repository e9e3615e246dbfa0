-- extend.lua: renew the lease of a claim that is current.
--
-- KEYS[1]  the record's Redis key (a hash; fields as in claim.lua)
-- ARGV[1]  the caller's fence
-- ARGV[2]  new lease in milliseconds, from now (integer > 0)
-- ARGV[3]  ttl in milliseconds (integer > 0)
-- ARGV[4]  the caller's claim token (see complete.lua)
--
-- Returns the new lease expiry in milliseconds, or 0 if the record is not
-- claimed with that fence and token. A second run would move the lease
-- again, so the backend never resends it after an attempt that may have
-- run. The fence does not change. Like Complete it has no lease test: a
-- holder whose lease lapsed but whom nobody replaced may renew.
local r = redis.call('HMGET', KEYS[1], 's', 'f', 't')
if r[1] ~= 'c' or tonumber(r[2]) ~= tonumber(ARGV[1]) or r[3] ~= ARGV[4] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = now + tonumber(ARGV[2])
local expires = lease + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'l', lease, 'e', expires)
redis.call('PEXPIREAT', KEYS[1], expires)
return lease
