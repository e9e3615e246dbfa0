-- claim.lua: create, reclaim or report the record for one key, atomically.
--
-- KEYS[1]  the record's Redis key (a hash)
-- ARGV[1]  lease in milliseconds (integer > 0)
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  claim token, unique per Claim call
-- ARGV[4]  "resend" when an earlier attempt of this call may have run and
--          its reply was lost; absent otherwise
--
-- Returns {outcome, fence, instant_ms}:
--   {1, fence, lease_expiry}  won, or re-affirmed: the record is claimed
--                             with this token, so an earlier attempt of this
--                             same call won and its reply was lost. The
--                             re-affirmed claim is that attempt's, unchanged:
--                             same fence, and the lease expiry it set (which
--                             may have passed, as after a slow reply). The
--                             call took effect once, when that attempt ran.
--   {2, fence, expires_at}    already done within the ttl
--   {3, fence, lease_expiry}  held by another live lease
--   {4, fence, 0}             a resend that does not find its own claim: it
--                             changes nothing, for it cannot tell whether
--                             the lost attempt won the key before the key
--                             moved on (a win now would be the call's
--                             second)
--
-- Hash fields: s = state ("c" claimed | "d" done), f = fence,
-- l = lease expiry (ms), e = expires at (ms), t = token of the last winner.
-- Instants: a lease is live while now < l and lapsed from now >= l; a done
-- record suppresses while now < e and is reclaimable from now >= e. Time is
-- the server's (TIME), never a client's. The key is set to expire
-- (PEXPIREAT) at e; Redis deletes it only once now > e.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 's', 'f', 'l', 'e', 't')
local fence = 0
if r[1] then
  fence = tonumber(r[2])
  if r[1] == 'c' and r[5] == ARGV[3] then
    return {1, fence, tonumber(r[3])}
  end
end
if ARGV[4] == 'resend' then
  return {4, fence, 0}
end
if r[1] then
  if r[1] == 'd' and now < tonumber(r[4]) then
    return {2, fence, tonumber(r[4])}
  end
  if r[1] == 'c' and now < tonumber(r[3]) then
    return {3, fence, tonumber(r[3])}
  end
end
fence = fence + 1
local lease = now + tonumber(ARGV[1])
local expires = lease + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 's', 'c', 'f', fence, 'l', lease, 'e', expires, 't', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], expires)
return {1, fence, lease}
