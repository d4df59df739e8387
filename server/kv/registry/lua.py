"""The Lua scripts of the Redis session registry: every write is one script, so it is atomic.

Redis runs one script at a time, so a script's reads and writes are one transaction: two
replicas purging expired sessions at once delete each session once and record its drops once,
and a delete and the drops it records land together. Layout under the prefix ``P``
(``lgkv:reg:{<namespace>}:``; the braces make a Redis Cluster keep a namespace in one slot):

- ``P s:<tenant>\\x1f<session>``: hash of the session's row (``num_tokens``, ``turns``,
  ``created_at``, ``last_used_at``, ``pinned``, ``ttl`` (absent: none), ``gap_count``,
  ``gap_mean``, ``managed``, ``pin_until`` (absent: no lease));
  ``P b:<tenant>\\x1f<session>``: list of its block keys.
- ``P t:<tenant>``: zset of the tenant's session ids by last use (listings: newest first, ties
  by id descending, its native reverse order; its size is the tenant's session count);
  ``P all``: set of every ``<tenant>\\x1f<session>`` (its size is the session count, read
  with SSCAN in chunks, never whole); ``P exp``: zset of them by expiry time;
  ``P pins``: zset of those pinned with a lease, by the time the lease lapses.
- ``P pin:<tenant>``, ``P mgd:<tenant>``: sets of the tenant's pinned and managed session ids
  (quotas read them; a superset, readers check each row; ``P layout`` >= 2 once a namespace
  written by older versions has been indexed into them).
- ``P refs``: hash block key -> number of sessions listing it (a delete frees the keys that
  reach 0).
- ``P changes``: stream of ``t``/``s`` (tenant, session) of every session write;
  ``P drops``: stream of ``keys`` (space-separated) freed by deletes and expiries. Both are
  trimmed to about ``ARGV[2]`` entries.
- ``P ver``: a counter every write increments (the engine's cheap "anything new?").

Every script takes ``ARGV[1]`` = the prefix and ``ARGV[2]`` = how many feed entries to keep;
times are unix seconds as text, written back with 17 significant digits.
"""

from __future__ import annotations

_COMMON = r"""
local P, KEPT = ARGV[1], ARGV[2]
local SEP = '\31'
local function fmt(x) return string.format('%.17g', x) end
local function skey(m) return P .. 's:' .. m end
local function bkey(m) return P .. 'b:' .. m end
local function flag(set, t, s, on) -- a tenant's pin / managed set
  redis.call(on and 'SADD' or 'SREM', P .. set .. ':' .. t, s)
end
local function change(t, s)
  redis.call('XADD', P .. 'changes', 'MAXLEN', '~', KEPT, '*', 't', t, 's', s)
  redis.call('INCR', P .. 'ver')
end
local function distinct(list)
  local seen, out = {}, {}
  for _, k in ipairs(list) do
    if not seen[k] then seen[k] = true; out[#out + 1] = k end
  end
  return out
end
local function ref(keys)
  for _, k in ipairs(distinct(keys)) do redis.call('HINCRBY', P .. 'refs', k, 1) end
end
local function unref(keys)
  local freed = {}
  for _, k in ipairs(distinct(keys)) do
    if redis.call('HINCRBY', P .. 'refs', k, -1) <= 0 then
      redis.call('HDEL', P .. 'refs', k)
      freed[#freed + 1] = k
    end
  end
  return freed
end
local function push(m, keys)
  for i = 1, #keys, 1000 do
    redis.call('RPUSH', bkey(m), unpack(keys, i, math.min(i + 999, #keys)))
  end
end
local function set_expiry(m, last, ttl)
  if ttl == nil or ttl == false or ttl == '' then
    redis.call('ZREM', P .. 'exp', m)
  else
    redis.call('ZADD', P .. 'exp', fmt(tonumber(last) + tonumber(ttl)), m)
  end
end
local function delete(t, s)
  local m = t .. SEP .. s
  if redis.call('EXISTS', skey(m)) == 0 then return nil end
  local keys = redis.call('LRANGE', bkey(m), 0, -1)
  redis.call('DEL', skey(m), bkey(m))
  redis.call('ZREM', P .. 't:' .. t, s)
  redis.call('SREM', P .. 'all', m)
  flag('pin', t, s, false)
  flag('mgd', t, s, false)
  redis.call('ZREM', P .. 'exp', m)
  redis.call('ZREM', P .. 'pins', m)
  change(t, s)
  return unref(keys)
end
local function drops(keys)
  if #keys > 0 then
    redis.call('XADD', P .. 'drops', 'MAXLEN', '~', KEPT, '*', 'keys', table.concat(keys, ' '))
    redis.call('INCR', P .. 'ver')
  end
end
local function add_session(m)
  -- The first session of a namespace: these scripts keep its pin/managed sets from the start.
  if redis.call('SADD', P .. 'all', m) == 1 and redis.call('SCARD', P .. 'all') == 1 then
    redis.call('SETNX', P .. 'layout', 2)
  end
end
local function expired(m, now)
  local row = redis.call('HMGET', skey(m), 'ttl', 'last_used_at')
  return row[1] and tonumber(row[2]) + tonumber(row[1]) < tonumber(now)
end
"""

CREATE = (
    _COMMON
    + r"""
-- ARGV: 3 tenant, 4 session, 5 now, 6 ttl ('' none), 7 pinned (0/1). Returns 1 if created.
local t, s, now, ttl = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local m = t .. SEP .. s
if redis.call('EXISTS', skey(m)) == 1 and expired(m, now) then drops(delete(t, s)) end
if redis.call('EXISTS', skey(m)) == 1 then return 0 end
redis.call('HSET', skey(m), 'num_tokens', 0, 'turns', 0, 'created_at', now,
  'last_used_at', now, 'pinned', ARGV[7], 'gap_count', 0, 'gap_mean', 0, 'managed', 1)
if ttl ~= '' then redis.call('HSET', skey(m), 'ttl', ttl) end
add_session(m)
redis.call('ZADD', P .. 't:' .. t, now, s)
flag('pin', t, s, ARGV[7] == '1')
flag('mgd', t, s, true)
set_expiry(m, now, ttl)
change(t, s)
return 1
"""
)

UPDATE = (
    _COMMON
    + r"""
-- ARGV: 3 tenant, 4 session, 5 set ttl (0/1), 6 ttl ('' none), 7 pinned ('' keep, 0/1),
-- 8 pin lease end ('' none: pinned until unpinned), 9 now. Returns 0 if unknown or expired.
local t, s = ARGV[3], ARGV[4]
local m = t .. SEP .. s
if redis.call('EXISTS', skey(m)) == 0 or expired(m, ARGV[9]) then return 0 end
redis.call('HSET', skey(m), 'managed', 1)
flag('mgd', t, s, true)
if ARGV[5] == '1' then
  if ARGV[6] == '' then redis.call('HDEL', skey(m), 'ttl')
  else redis.call('HSET', skey(m), 'ttl', ARGV[6]) end
  set_expiry(m, redis.call('HGET', skey(m), 'last_used_at'), ARGV[6])
end
if ARGV[7] ~= '' then
  redis.call('HSET', skey(m), 'pinned', ARGV[7])
  flag('pin', t, s, ARGV[7] == '1')
  if ARGV[7] == '1' and ARGV[8] ~= '' then
    redis.call('HSET', skey(m), 'pin_until', ARGV[8])
    redis.call('ZADD', P .. 'pins', ARGV[8], m)
  else
    redis.call('HDEL', skey(m), 'pin_until')
    redis.call('ZREM', P .. 'pins', m)
  end
end
change(t, s)
return 1
"""
)

MARK_MANAGED = (
    _COMMON
    + r"""
-- ARGV: 3 tenant, 4 session.
local t, s = ARGV[3], ARGV[4]
local m = t .. SEP .. s
if redis.call('EXISTS', skey(m)) == 1 then
  redis.call('HSET', skey(m), 'managed', 1)
  flag('mgd', t, s, true)
end
change(t, s)
return 1
"""
)

RECORD_TURN = (
    _COMMON
    + r"""
-- ARGV: 3 tenant, 4 session, 5 now, 6 num_tokens, 7 default ttl ('' none), 8.. block keys.
local t, s, now, dttl = ARGV[3], ARGV[4], ARGV[5], ARGV[7]
local m = t .. SEP .. s
local keys = {}
for i = 8, #ARGV do keys[#keys + 1] = ARGV[i] end
local row = redis.call('HMGET', skey(m), 'turns', 'last_used_at', 'gap_count', 'gap_mean', 'ttl')
if row[1] and row[5] and tonumber(row[2]) + tonumber(row[5]) < tonumber(now) then
  -- Expired, not purged yet: it starts over as a new session (its superseded blocks stay in
  -- the tiers' LRU, as any turn's).
  redis.call('DEL', skey(m))
  redis.call('ZREM', P .. 'pins', m)
  row = {false}
end
local ttl = row[5]
if not row[1] then
  redis.call('HSET', skey(m), 'num_tokens', ARGV[6], 'turns', 1, 'created_at', now,
    'last_used_at', now, 'pinned', 0, 'gap_count', 0, 'gap_mean', 0, 'managed', 0)
  if dttl ~= '' then redis.call('HSET', skey(m), 'ttl', dttl) end
  ttl = dttl
  add_session(m)
  flag('pin', t, s, false)
  flag('mgd', t, s, false)
else
  local turns, count, mean = tonumber(row[1]), tonumber(row[3]), tonumber(row[4])
  if turns > 0 then
    local gap = math.max(0, tonumber(now) - tonumber(row[2]))
    count = count + 1
    mean = mean + (gap - mean) / count
  end
  redis.call('HSET', skey(m), 'num_tokens', ARGV[6], 'turns', turns + 1, 'last_used_at', now,
    'gap_count', count, 'gap_mean', fmt(mean))
end
redis.call('ZADD', P .. 't:' .. t, now, s)
set_expiry(m, now, ttl)
unref(redis.call('LRANGE', bkey(m), 0, -1))  -- superseded blocks stay in the tiers' LRU
redis.call('DEL', bkey(m))
push(m, keys)
ref(keys)
change(t, s)
return 1
"""
)

DELETE = (
    _COMMON
    + r"""
-- ARGV: 3 tenant, 4 session. Returns {found (0/1), freed keys...}.
local freed = delete(ARGV[3], ARGV[4])
if freed == nil then return {0} end
drops(freed)
local out = {1}
for _, k in ipairs(freed) do out[#out + 1] = k end
return out
"""
)

COPY = (
    _COMMON
    + r"""
-- ARGV: 3 tenant, 4 source, 5 target, 6 overwrite (0/1), 7 now. Returns a status word.
-- An expired source is missing; an expired target is free (deleted, its freed keys dropped).
local t, src, dst, now = ARGV[3], ARGV[4], ARGV[5], ARGV[7]
local ms, md = t .. SEP .. src, t .. SEP .. dst
if redis.call('EXISTS', skey(ms)) == 0 or expired(ms, now) then return 'no_source' end
if redis.call('EXISTS', skey(md)) == 1 and expired(md, now) then drops(delete(t, dst)) end
if redis.call('EXISTS', skey(md)) == 1 then
  if ARGV[6] ~= '1' then return 'target_exists' end
  delete(t, dst)  -- blocks the old target alone held stay in the tiers' LRU
end
local r = redis.call('HMGET', skey(ms), 'num_tokens', 'turns', 'ttl', 'gap_count', 'gap_mean')
redis.call('HSET', skey(md), 'num_tokens', r[1], 'turns', r[2], 'created_at', now,
  'last_used_at', now, 'pinned', 0, 'gap_count', r[4], 'gap_mean', r[5], 'managed', 1)
if r[3] then redis.call('HSET', skey(md), 'ttl', r[3]) end
local keys = redis.call('LRANGE', bkey(ms), 0, -1)
push(md, keys)
ref(keys)
add_session(md)
flag('pin', t, dst, false)
flag('mgd', t, dst, true)
redis.call('ZADD', P .. 't:' .. t, now, dst)
set_expiry(md, now, r[3])
change(t, dst)
return 'ok'
"""
)

PURGE = (
    _COMMON
    + r"""
-- ARGV: 3 now, 4 limit. One bounded batch: deletes up to `limit` sessions whose last use +
-- TTL < now (earliest first) and unpins up to `limit` whose pin lease ended before now.
-- Returns {1 if more is due else 0, the freed keys...}; the caller runs batches until 0.
local limit = tonumber(ARGV[4])
local freed, seen = {}, {}
local function first(zset) -- up to limit + 1 members scored before now
  return redis.call('ZRANGEBYSCORE', P .. zset, '-inf', '(' .. ARGV[3], 'LIMIT', 0, limit + 1)
end
local due = first('exp')
local more = #due > limit
for n, m in ipairs(due) do
  if n > limit then break end
  local i = string.find(m, SEP, 1, true)
  for _, k in ipairs(delete(string.sub(m, 1, i - 1), string.sub(m, i + 1)) or {}) do
    if not seen[k] then seen[k] = true; freed[#freed + 1] = k end
  end
end
drops(freed)
local lapsed = first('pins')
if #lapsed > limit then more = true; lapsed[#lapsed] = nil end
for _, m in ipairs(lapsed) do
  redis.call('ZREM', P .. 'pins', m)  -- a lease that ran out: an ordinary session again
  if redis.call('EXISTS', skey(m)) == 1 then
    redis.call('HSET', skey(m), 'pinned', 0)
    redis.call('HDEL', skey(m), 'pin_until')
    local i = string.find(m, SEP, 1, true)
    flag('pin', string.sub(m, 1, i - 1), string.sub(m, i + 1), false)
    change(string.sub(m, 1, i - 1), string.sub(m, i + 1))
  end
end
local out = {more and 1 or 0}
for _, k in ipairs(freed) do out[#out + 1] = k end
return out
"""
)

ADD_DROPS = (
    _COMMON
    + r"""
-- ARGV: 3.. keys.
local keys = {}
for i = 3, #ARGV do keys[#keys + 1] = ARGV[i] end
drops(keys)
return #keys
"""
)
