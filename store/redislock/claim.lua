-- claim.lua: create, reclaim or report the record for one key, atomically.
-- Runs after record.lua (the format, load_record, save_record, now).
--
-- KEYS[1]  the record's Redis key
-- ARGV[1]  lease in milliseconds (integer > 0)
-- ARGV[2]  ttl in milliseconds (integer > 0)
-- ARGV[3]  claim token, unique per Claim call
-- ARGV[4]  "resend" when an earlier attempt of this call may have run and
--          its reply was lost; absent otherwise
--
-- Returns {outcome, fence, instant_ms[, fingerprint]}:
--   {1, fence, lease_expiry}  won, or re-affirmed: the record is claimed
--                             with this token, so an earlier attempt of this
--                             same call won and its reply was lost. The
--                             re-affirmed claim is that attempt's, unchanged:
--                             same fence, and the lease expiry it set (which
--                             may have passed, as after a slow reply). The
--                             call took effect once, when that attempt ran.
--   {2, fence, expires_at, fp} already done within the ttl; fp is the
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
-- then. Time is the server's (TIME), never a client's.
local s, f, at, t, fp = load_record(KEYS[1])
local fence = 0
if s then
  fence = f
  if s == 'c' and t == ARGV[3] then
    return {1, f, at}
  end
end
if ARGV[4] == 'resend' then
  return {4, fence, 0}
end
local n = now()
if s == 'd' and n < at then
  return {2, f, at, fp}
end
if s == 'c' and n < at then
  return {3, f, at}
end
fence = fence + 1
local lease = n + tonumber(ARGV[1])
save_record(KEYS[1], 'c', fence, lease, ARGV[3], '', lease + tonumber(ARGV[2]))
return {1, fence, lease}
