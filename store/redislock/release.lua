-- release.lua: give up a claim: end its lease now and raise the fence.
-- Runs after record.lua (the format and its functions).
--
-- KEYS[1]  the record's Redis key
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
local s, f, _, t = load_record(KEYS[1])
if s ~= 'c' or f ~= tonumber(ARGV[1]) or t ~= ARGV[3] then
  return 0
end
local n = now()
save_claimed(KEYS[1], f + 1, n, t, n + tonumber(ARGV[2]))
return 1
