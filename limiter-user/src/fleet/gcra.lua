-- GCRA check-and-consume on Redis's own clock: the agent's buckets/gcra.rs, in whole
-- microseconds, run atomically so that every agent of the fleet shares one exact bucket.
--
-- KEYS[1]  the bucket: its theoretical arrival time (TAT), microseconds on Redis's clock
-- ARGV[1]  emission interval (the time one token takes to come back), microseconds
-- ARGV[2]  tolerance (the burst as time: burst x emission), microseconds
-- ARGV[3]  cost, ARGV[4] burst, ARGV[5] "1" to spend, "0" to peek
-- Returns {allowed (1/0), remaining tokens, retry_after (-1: never), reset_after}, the
-- durations in microseconds. A refusal spends nothing; the key expires when the bucket is
-- full again. Every number stays below 2^53, so Lua's doubles hold it exactly.
if redis.replicate_commands then
  -- Before Redis 5, only a script replicated by its effects may read the clock.
  redis.replicate_commands()
end
local emission = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local start = tonumber(redis.call('GET', KEYS[1]) or now)
if start < now then
  start = now
end
local function tokens(debt)
  local left = math.floor((tolerance - debt) / emission)
  if left < 0 then
    return 0
  end
  return left
end
local new_tat = start + emission * cost
local debt_after = new_tat - now
if cost <= burst and debt_after <= tolerance then
  if ARGV[5] == '1' then
    redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', math.ceil(debt_after / 1000))
  end
  return {1, tokens(debt_after), 0, debt_after}
end
local retry_after = -1
if cost <= burst then
  retry_after = debt_after - tolerance
end
return {0, tokens(start - now), retry_after, start - now}
