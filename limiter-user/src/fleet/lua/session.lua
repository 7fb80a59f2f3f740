-- One key's sessions in the fleet: a sorted set of leases, each member a session's name in
-- the fleet (its agent, its protocol connection, the broker's name for it) scored by the
-- lease's end in milliseconds on Redis's clock. Run atomically, so concurrent acquires from
-- every agent never hold more than the limit.
--
-- KEYS[1]  the key's leases
-- ARGV[1]  "acquire" (take ARGV[5]'s lease if it fits, or renew it if held) or "count"
-- ARGV[2]  limit, ARGV[3] lease (ms), ARGV[4] "1" to take it even over the limit (monitor
--          mode), ARGV[5] the member
-- Returns {fits (1/0), leases live after}: for "count", whether one more would fit.
-- Lapsed leases (an agent that died stopped renewing them) are dropped first; the key
-- expires with its last lease.
if redis.replicate_commands then
  -- Before Redis 5, only a script replicated by its effects may read the clock.
  redis.replicate_commands()
end
local limit = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if ARGV[1] == 'count' then
  if held < limit then
    return {1, held}
  end
  return {0, held}
end
local member = ARGV[5]
if redis.call('ZSCORE', KEYS[1], member) then
  -- Held already: an acquire repeated on the same connection is not counted twice.
  redis.call('ZADD', KEYS[1], now + lease, member)
  redis.call('PEXPIRE', KEYS[1], lease)
  return {1, held}
end
if held < limit or ARGV[4] == '1' then
  redis.call('ZADD', KEYS[1], now + lease, member)
  redis.call('PEXPIRE', KEYS[1], lease)
  return {held < limit and 1 or 0, held + 1}
end
return {0, held}
