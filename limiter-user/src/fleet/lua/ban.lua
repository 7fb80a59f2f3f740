-- Places or lifts a fleet ban and tells every agent, in one atomic step on Redis's clock.
-- KEYS[1]: the bans in force, a sorted set of addresses scored by expiry (ms since the epoch).
-- KEYS[2]: the ban log, a stream every agent follows.
-- ARGV: 'ban' or 'unban', the address, the TTL in ms, the sending agent, the log's length.
-- Returns 1 if the set changed (always for a ban; for an unban, whether a ban was in force).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local changed = 1
if ARGV[1] == 'ban' then
  local expiry = now + tonumber(ARGV[3])
  redis.call('ZADD', KEYS[1], expiry, ARGV[2])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*',
    'op', 'ban', 'addr', ARGV[2], 'expiry', expiry, 'origin', ARGV[4])
else
  changed = redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*',
    'op', 'unban', 'addr', ARGV[2], 'origin', ARGV[4])
end
-- The set lives as long as its longest ban.
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIREAT', KEYS[1], last[2])
end
return changed
