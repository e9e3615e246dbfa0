-- claim.lua: create, reclaim or report the record for one key, atomically.
-- Runs after claim_fresh.lua (the fresh key's path, which sets n, lease,
-- expires and old) and record.lua (the format and its functions).
--
-- KEYS[1]  the record's Redis key
-- ARGV[1]  lease in milliseconds (integer > 0)
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  claim token, unique per Claim call
-- ARGV[4]  "resend" when an earlier attempt of this call may have run and
--          its reply was lost; absent otherwise
--
-- Returns lease_expiry (an integer, not a table) when it won a key that had
-- no record: the claim's fence is 1. Otherwise
-- {outcome, fence, instant_ms[, fingerprint]}:
--   {1, fence, lease_expiry}  won, or re-affirmed: the record is claimed
--                             with this token, so an earlier attempt of this
--                             same call won and its reply was lost. The
--                             re-affirmed claim is that attempt's, unchanged:
--                             same fence, and the lease expiry it set (which
--                             may have passed, as after a slow reply). The
--                             call took effect once, when that attempt ran.
--   {2, fence, expires_at, fp} already done within the ttl (expires_at -1:
--                             the key has no expiry); fp is the
--                             stored fingerprint ('' for none)
--   {3, fence, lease_expiry}  held by another live lease
--   {4, fence, 0}             a resend that does not find its own claim: it
--                             changes nothing, for it cannot tell whether
--                             the lost attempt won the key before the key
--                             moved on (a win now would be the call's
--                             second)
--
-- Instants: a lease is live while now < lease expiry and lapsed from then;
-- a done record suppresses while now < expires-at and is reclaimable from
-- then. Time is the server's (TIME), never a client's. A fresh key costs
-- two commands: TIME, and a SET NX ... GET that creates the record or
-- returns the one there.
--
-- The fresh path (claim_fresh.lua) is what most deliveries run; it comes
-- before record.lua, whose functions it does not need.
if ARGV[4] == 'resend' then
  local s, f, at, t = load_record(KEYS[1])
  if s == 'c' and t == ARGV[3] then
    return {1, f, at}
  end
  return {4, f or 0, 0}
end
local s, f, at, t, fp = decode(KEYS[1], old)
if s == 'd' then
  at = redis.call('PEXPIRETIME', KEYS[1])
  -- -1: the key has no expiry (someone ran PERSIST on it): the record
  -- never reaches its expires-at, so it stays done (reported as -1).
  if at < 0 or n < at then
    return {2, f, at, fp}
  end
elseif n < at then
  return {3, f, at}
end
save_claimed(KEYS[1], f + 1, lease, ARGV[3], expires)
return {1, f + 1, lease}
