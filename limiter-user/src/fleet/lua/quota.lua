-- A quota's check-and-spend, atomic on the server and timed by the server's clock.
-- KEYS[1]: the key's quota, a hash {w = window index, n = spent in it}.
-- ARGV: limit, period (ms), expiry margin (ms), cost, spend (1) or peek (0).
-- Returns {allowed (0/1), remaining, retry_after_ms (-1: never), reset_after_ms}.
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local margin = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local window = math.floor(now / period)
local window_end = (window + 1) * period
local rollover = window_end - now
local stored = redis.call('HMGET', KEYS[1], 'w', 'n')
local spent = 0
if tonumber(stored[1]) == window then
  spent = tonumber(stored[2]) or 0
end
local left = limit - spent
if cost <= left then
  if ARGV[5] == '1' then
    redis.call('HSET', KEYS[1], 'w', window, 'n', spent + cost)
    -- The key outlives its window by the margin, then Redis forgets it.
    redis.call('PEXPIREAT', KEYS[1], window_end + margin)
  end
  return {1, left - cost, 0, rollover}
end
-- Refused: nothing is written, so nothing is spent.
local retry = rollover
if cost > limit then
  retry = -1
end
local reset = rollover
if spent == 0 then
  reset = 0
end
return {0, left, retry, reset}
