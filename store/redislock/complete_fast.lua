-- complete_fast.lua: the first part of complete.lua (see its header for
-- KEYS, ARGV and the reply), put in front of record.lua: a record that is
-- still exactly the claim the caller holds, what every delivery's Complete
-- finds, is settled here, before record.lua defines its functions (which
-- Redis would otherwise build on every call). It leaves v, the GET's
-- reply, to complete.lua.
--
-- Redis spends more on a script's own Lua, and on each ARGV element, than
-- on its commands: the caller sends the claimed value it holds and the
-- done value to write, so this path compares two strings (Lua interns
-- them: one pointer comparison) and writes one, with no pattern matching,
-- number conversion or concatenation.
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
