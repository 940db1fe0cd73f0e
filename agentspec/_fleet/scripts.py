"""The Lua scripts that change a tenant's snapshots, compaction marks and stream.

Each runs atomically in Redis and touches only the tenant's keys (declared
in KEYS, so they work under a tenant's ACL user and in one Cluster slot).
Stream ids are compared as (ms, seq) pairs; Lua numbers hold them exactly
up to 2**53, far beyond any ``XADD *`` id.  A stored mark that is not a
stream id (damaged metadata) reads as ``0-0``, never a script error.

- `PUT_SNAPSHOT` (compare-and-set): writes a shard's snapshot and the id it
  covers unless the stored one already covers that id or a later one, so a
  slow compactor can never replace a newer snapshot with an older one.  In
  ``bump`` mode it writes no bytes: it only moves the stored snapshot's
  covered id forward, and only when that snapshot already covers the last
  entry of the shard the caller has seen (then it holds the same state).
- `FINISH_ROUND`: after a compactor has put or bumped a snapshot of every
  shard it knows at position P, raises ``round`` to P (the old value
  becomes ``prev``), then trims the stream (``XTRIM MINID``) to the lowest
  of ``prev`` and every snapshot's covered id, and records that id as
  ``trimmed``.  Trimming behind the *previous* round leaves one round of
  entries as slack, so subscribers less than a round behind the compactor
  keep tailing instead of reloading.  See docs/fleet.md for why no entry
  that some snapshot lacks is ever trimmed.
- `TAIL_INFO`: ``{backed, last generated id, length}`` for a subscriber's
  read loop.  ``backed`` is 1 while the subscriber's position is still
  backed by the stream: the entry at that position still exists (so
  nothing after it was trimmed, and a Redis restart did not lose it), or,
  at ``0-0``, nothing was ever trimmed.  The check is made on whatever
  server answers, so it also holds when the client reconnected silently.
- `READ`: the subscriber's bounded read: what `TAIL_INFO` tells plus the
  entries after its position, fetched one at a time inside Redis so that
  an entry over the size limit is returned as its id and size only, and
  the batch stops once it holds a byte budget (at least one entry); also
  the id of the first entry it left unread (for lag in wall time) and the
  tenant's stored ``depth`` and ``budget``.
- `RELEASE_LOCK`: deletes the compaction lease if it still holds our token.
- `XADD_CHECKED`: the publisher's ``XADD``: writes the publisher's view of
  the tenant config if Redis has none (``HSETNX``), and refuses the entry
  (error ``AGENTSPEC_CONFIG``) when the stored depth differs from the one
  the entry was encoded for.
- `VERIFY`: for the publisher's durability window (`_fleet_window`):
  whether each acknowledged entry is still at its stream id with the same
  key and identity, or below the ``trimmed`` mark (then a snapshot holds
  it, since trimming only follows snapshots).
"""

from __future__ import annotations

_ID = """
local function sid(s)
  local a, b = string.match(tostring(s), '^(%d+)-(%d+)$')
  if not a then return 0, 0 end
  return tonumber(a), tonumber(b)
end
local function valid(s)
  return s and string.match(tostring(s), '^%d+%-%d+$') ~= nil
end
local function less(x, y)
  local a1, b1 = sid(x)
  local a2, b2 = sid(y)
  if a1 ~= a2 then return a1 < a2 end
  return b1 < b2
end
"""

#: KEYS: snap, index.  ARGV: name, covered, mode ('put' | 'bump'), last_seen, data, key, gone.
#: Returns 1 when the stored snapshot now covers ``covered``, 0 when a bump was refused.
PUT_SNAPSHOT = (
    _ID
    + """
local cur = redis.call('HGET', KEYS[1], 'covered')
if cur and not less(cur, ARGV[2]) then return 1 end
if ARGV[3] == 'bump' then
  if not cur or less(cur, ARGV[4]) then return 0 end
  redis.call('HSET', KEYS[1], 'covered', ARGV[2])
else
  redis.call('HSET', KEYS[1], 'covered', ARGV[2], 'data', ARGV[5], 'key', ARGV[6],
             'gone', ARGV[7], 'v', '1')
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""
)

#: KEYS: meta, index, stream.  ARGV: position.  Returns {trimmed id, entries removed}.
FINISH_ROUND = (
    _ID
    + """
local round = redis.call('HGET', KEYS[1], 'round')
if not valid(round) then round = nil end
if not round or less(round, ARGV[1]) then
  if round then redis.call('HSET', KEYS[1], 'prev', round) end
  redis.call('HSET', KEYS[1], 'round', ARGV[1])
end
local low = redis.call('HGET', KEYS[1], 'prev')
local trimmed = redis.call('HGET', KEYS[1], 'trimmed')
if not valid(trimmed) then trimmed = nil end
if not valid(low) then return {trimmed or '0-0', 0} end
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do
  if not valid(v) then v = '0-0' end
  if less(v, low) then low = v end
end
if trimmed and not less(trimmed, low) then return {trimmed, 0} end
local n = redis.call('XTRIM', KEYS[3], 'MINID', low)
redis.call('HSET', KEYS[1], 'trimmed', low)
return {low, n}
"""
)

#: KEYS: meta, stream.  ARGV: position.  Returns {backed (1 | 0), last generated id, length}.
TAIL_INFO = """
local backed = 0
if ARGV[1] == '0-0' then
  local trimmed = redis.call('HGET', KEYS[1], 'trimmed')
  if not trimmed or trimmed == '0-0' then backed = 1 end
elseif #redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1], 'COUNT', 1) > 0 then
  backed = 1
end
if redis.call('EXISTS', KEYS[2]) == 0 then return {backed, '0-0', 0} end
local info = redis.call('XINFO', 'STREAM', KEYS[2])
local head = '0-0'
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then head = info[i + 1] end
end
return {backed, head, redis.call('XLEN', KEYS[2])}
"""

#: KEYS: meta, stream, index.  ARGV: position, count, max entry bytes, max batch bytes,
#: force (1: read even when the position is not backed).
#: Returns {backed, last generated id, length, entries, next id or nil, depth, budget,
#: snapshots indexed, epoch}; an entry is {id, {field, value, ...}}, or {id, size} when
#: over the entry limit.
READ = """
local pos, count = ARGV[1], tonumber(ARGV[2])
local max_entry, max_batch = tonumber(ARGV[3]), tonumber(ARGV[4])
local function get(...)  -- damaged metadata (a key of the wrong type) reads as missing
  local ok, v = pcall(redis.call, ...)
  if ok and v then return v end
  return false
end
local indexed = get('HLEN', KEYS[3])
if indexed == false then indexed = 1 end  -- unreadable: never taken for "gone"
local epoch = get('HGET', KEYS[1], 'epoch')
local backed = 0
if pos == '0-0' then
  local trimmed = get('HGET', KEYS[1], 'trimmed')
  if not trimmed or trimmed == '0-0' then backed = 1 end
elseif #redis.call('XRANGE', KEYS[2], pos, pos, 'COUNT', 1) > 0 then
  backed = 1
end
local depth = get('HGET', KEYS[1], 'depth')
local budget = get('HGET', KEYS[1], 'budget')
if redis.call('EXISTS', KEYS[2]) == 0 then
  return {backed, '0-0', 0, {}, false, depth, budget, indexed, epoch}
end
local info = redis.call('XINFO', 'STREAM', KEYS[2])
local head = '0-0'
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then head = info[i + 1] end
end
local out, total, start, nxt = {}, 0, '(' .. pos, false
if backed == 1 or ARGV[5] == '1' then
  while true do
    local e = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', 1)
    if #e == 0 then break end
    local id, f = e[1][1], e[1][2]
    if #out >= count then nxt = id break end
    local size = 0
    for j = 1, #f do size = size + #f[j] end
    if size > max_entry then
      out[#out + 1] = {id, size}
    else
      if #out > 0 and total + size > max_batch then nxt = id break end
      total = total + size
      out[#out + 1] = {id, f}
    end
    start = '(' .. id
  end
end
return {backed, head, redis.call('XLEN', KEYS[2]), out, nxt, depth, budget, indexed, epoch}
"""

#: KEYS: lock.  ARGV: token.
RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: KEYS: meta, stream.  ARGV: depth, budget, then the entry's field / value pairs.
XADD_CHECKED = """
redis.call('HSETNX', KEYS[1], 'depth', ARGV[1])
redis.call('HSETNX', KEYS[1], 'budget', ARGV[2])
local depth = redis.call('HGET', KEYS[1], 'depth')
if depth ~= ARGV[1] then
  return redis.error_reply('AGENTSPEC_CONFIG the tenant depth is ' .. depth)
end
return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
"""

#: KEYS: meta, stream.  ARGV: (stream id, key JSON, identity) triples.
#: Returns one 1 (present, or trimmed behind a snapshot) or 0 (lost) per triple.
VERIFY = (
    _ID
    + """
local trimmed = redis.call('HGET', KEYS[1], 'trimmed') or '0-0'
local out = {}
for n = 1, #ARGV, 3 do
  local ok = 0
  local e = redis.call('XRANGE', KEYS[2], ARGV[n], ARGV[n], 'COUNT', 1)
  if #e > 0 then
    local f, k, i = e[1][2], nil, nil
    for j = 1, #f, 2 do
      if f[j] == 'k' then k = f[j + 1] elseif f[j] == 'i' then i = f[j + 1] end
    end
    if k == ARGV[n + 1] and i == ARGV[n + 2] then ok = 1 end
  elseif less(ARGV[n], trimmed) then
    ok = 1
  end
  out[#out + 1] = ok
end
return out
"""
)
