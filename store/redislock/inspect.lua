-- inspect.lua: read one key's record and the server's clock, changing
-- nothing. Runs after record.lua (the format and its functions).
--
-- KEYS[1]  the record's Redis key
--
-- Returns, every instant in Unix ms by the server's clock:
--   {1, now, state, fence, lease_expiry, expires_at, token, fingerprint}
--                 a record: state 'c' or 'd'; lease_expiry -1 for a done
--                 record (its value keeps none); expires_at the key's own
--                 expiry (PEXPIRETIME: a done record's expires-at, a
--                 claimed one's lease expiry + ttl), -1 when the key has no
--                 expiry (someone ran PERSIST on it); fingerprint '' for
--                 none. The token goes to the backend only, which reports
--                 its digest (store.VersionOf), never the token.
--   {0, now}      no record.
--   {-1, now, message}
--                 the key holds something that is not a record.
--
-- now is read (TIME) in the same script as the record, so it is the clock
-- at the read, the one Claim would judge the record by. The script writes
-- nothing: a record past its lease or ttl is reported as stored.
local n = now()
local ok, s, f, at, t, fp = pcall(load_record, KEYS[1])
if not ok then
  local msg = s
  if type(s) == 'table' then
    msg = s.err or 'error'
  end
  return {-1, n, tostring(msg)}
end
if not s then
  return {0, n}
end
return {1, n, s, f, at or -1, redis.call('PEXPIRETIME', KEYS[1]), t, fp or ''}
