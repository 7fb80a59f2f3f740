-- Renews one agent's leases of one key (see session.lua): each held lease is extended; one
-- that lapsed (the agent could not renew it in time) is taken again if the key has room.
--
-- KEYS[1]  the key's leases
-- ARGV[1]  lease (ms), ARGV[2] limit, ARGV[3..] the agent's members of the key
-- Returns how many of them lapsed and found no room: sessions the fleet no longer counts.
if redis.replicate_commands then
  redis.replicate_commands()
end
local lease = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lost = 0
for i = 3, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) or redis.call('ZCARD', KEYS[1]) < limit then
    redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
  else
    lost = lost + 1
  end
end
if redis.call('ZCARD', KEYS[1]) > 0 then
  redis.call('PEXPIRE', KEYS[1], lease)
end
return lost
