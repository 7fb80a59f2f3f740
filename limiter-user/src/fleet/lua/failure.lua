-- Counts one authentication failure of an address across the fleet.
-- KEYS[1]: the address's counter. ARGV: the window (ms), the failures tolerated, the ban (ms).
-- The window starts at the first failure; the failure that crosses the threshold makes the
-- counter last as long as the ban, so counting starts afresh when the ban ends.
-- Returns the failures counted in the window, this one included.
local n = redis.call('INCR', KEYS[1])
if n == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
if n == tonumber(ARGV[2]) + 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return n
