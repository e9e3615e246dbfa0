-- forget.lua: delete a done record if it is still the one an operator read.
-- Runs after record.lua (the format and its functions).
--
-- KEYS[1]  the record's Redis key
-- ARGV[1]  the fence the operator read
-- ARGV[2]  the claim token the record held when the backend read it (the
--          operator's version is a digest of it, which Lua cannot compute:
--          the backend reads the token, checks its digest, and passes it
--          here)
--
-- Returns 1 if it deleted the record: done, with that fence and token,
-- whether or not its ttl has passed (Redis has not deleted it yet). Returns
-- 0, changing nothing, for no record, a claimed record (live or lapsed: a
-- claim is never deleted), or another fence or token (the record moved on
-- or was created afresh since the read). A resend after a lost reply finds
-- no record and returns 0.
local s, f, _, t = load_record(KEYS[1])
if s ~= 'd' or f ~= tonumber(ARGV[1]) or t ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
