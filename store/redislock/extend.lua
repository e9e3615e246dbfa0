-- extend.lua: renew the lease of a claim that is current.
-- Runs after record.lua (the format and its functions).
--
-- KEYS[1]  the record's Redis key
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
local s, f, _, t = load_record(KEYS[1])
if s ~= 'c' or f ~= tonumber(ARGV[1]) or t ~= ARGV[4] then
  return 0
end
local lease = now() + tonumber(ARGV[2])
save_claimed(KEYS[1], f, lease, t, lease + tonumber(ARGV[3]))
return lease
