-- complete_fast.lua: the first part of complete.lua (see its header for
-- KEYS, ARGV and the reply), put in front of record.lua: a string record,
-- what every delivery's Complete finds, is settled here, before record.lua
-- defines its functions (which Redis would otherwise build on every call).
-- It leaves v, the GET's reply, to complete.lua.
--
-- A string record (every record but the earlier format's hashes) is read
-- in place, its fence compared as the decimal string it is (both sides are
-- written without leading zeros), with no number conversion: Redis spends
-- more on a script's own Lua than on its commands.
local v = redis.pcall('GET', KEYS[1])
if not v then
  return 0
end
if type(v) == 'string' then
  local s, f, t = string.match(v, '^([cd])(%d+),%d*,([^,]*)')
  if s then
    if f ~= ARGV[1] or t ~= ARGV[3] then
      return 0
    end
    if s == 'd' then
      return 1
    end
    if ARGV[4] ~= '' then
      t = t .. ',' .. ARGV[4]
    end
    redis.call('SET', KEYS[1], 'd' .. f .. ',,' .. t, 'PX', ARGV[2])
    return 1
  end
end
