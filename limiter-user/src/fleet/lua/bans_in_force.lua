-- The bans in force and where the log stands, read together so that following the log from
-- `last` misses nothing and repeats nothing.
-- KEYS[1]: the bans in force; KEYS[2]: the ban log.
-- Returns {first log id or '', last log id or '0-0', now (ms), {address, expiry, ...}}.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local bans = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local first_id = ''
if first[1] then
  first_id = first[1][1]
end
local last_id = '0-0'
if last[1] then
  last_id = last[1][1]
end
return {first_id, last_id, now, bans}
