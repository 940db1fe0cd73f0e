"""The fleet's Redis function library: every write, and the reads that need atomicity.

The admin loads it once (``FUNCTION LOAD``, `agentspec fleet setup`;
`_fleet_functions` loads it on demand for a user allowed to), and tenant
users may only call its functions (``FCALL`` / ``FCALL_RO``), never
``EVAL``: see `tenant_acl_rules`.  The library's name carries its version
(`LIBRARY_NAME`), so an upgraded library loads beside the old one.

Every function checks its keys: all of one tenant (``agentspec:{T}:``) and
each of the kind it expects, so a caller can neither touch another tenant
(the ACL key patterns refuse that too) nor create keys of its own choosing.
Stream ids are compared as (ms, seq) pairs; Lua numbers hold them exactly
up to 2**53, far beyond any ``XADD *`` id.

- ``put_snapshot`` (compare-and-set): writes a shard's snapshot and the id
  it covers unless the stored one already covers that id or a later one, so
  a slow compactor can never replace a newer snapshot with an older one.
  In ``bump`` mode it writes no bytes: it only moves the stored snapshot's
  covered id forward, and only when that snapshot already covers the last
  entry of the shard the caller has seen (then it holds the same state).
- ``finish_round``: after a compactor has put or bumped a snapshot of every
  shard it knows at position P, raises ``round`` to P (the old value
  becomes ``prev``), then trims the stream (``XTRIM MINID``) to the lowest
  of ``prev`` and every snapshot's covered id, and records that id as
  ``trimmed``.  See docs/fleet.md for why no entry that some snapshot
  lacks is ever trimmed.
- ``read`` (read-only): a subscriber's bounded read: ``backed`` (the
  entry at its position still exists, or, at ``0-0``, nothing was ever
  trimmed), the stream's last generated id and length, then the entries
  after its position, fetched one at a time inside Redis so that an entry
  over the size limit comes back as its id and size only, stopping once
  the batch holds a byte budget (at least one entry); also the id of the
  first entry left unread (for lag in wall time), the stored ``depth`` and
  ``budget``, the number of snapshots indexed and the re-seed ``epoch``.
  Stored marks that are not stream ids (damaged metadata) read as ``0-0``
  in every function, never as an error.
- ``lock`` / ``unlock``: the compaction lease (a hash field with a
  bounded expiry; ``unlock`` only while it holds our token).
- ``init_config``: writes the tenant config (depth, budget) unless Redis
  has one (``HSETNX``) and returns what Redis holds.
- ``xadd``: the publisher's ``XADD``: exactly the fields ``v k i d``, at
  most `MAX_ENTRY` bytes; writes the config if Redis has none and refuses
  the entry (error ``AGENTSPEC_CONFIG``) when the stored depth differs from
  the one the entry was encoded for.
- ``verify`` (read-only): for the publisher's durability window: whether
  each acknowledged entry is still at its stream id with the same key and
  identity, or below the ``trimmed`` mark.
- ``beat``: writes (or, with an empty record, removes) one subscriber's
  heartbeat in the tenant's heartbeat hash, at most `MAX_BEAT` bytes, with
  its expiry in a sorted set; prunes expired or oversize records (bounded
  work per call) and caps the records at `MAX_BEATS`.
- ``beats`` (read-only): the live records, an oversize one by its size
  only (never fetched).
"""

from __future__ import annotations

__all__ = ["LIBRARY", "LIBRARY_NAME", "MAX_BEAT", "MAX_BEATS", "MAX_BEAT_TTL_MS", "MAX_ENTRY"]

#: The library's name, with its version: functions are ``<LIBRARY_NAME>_<name>``.
LIBRARY_NAME = "agentspec_v1"
#: Most bytes of one stream entry's field names and values (`_fleet_entry` limit + slack).
MAX_ENTRY = (4 << 20) + 64
#: Most bytes of one heartbeat record.
MAX_BEAT = 4096
#: Most heartbeat records per tenant.
MAX_BEATS = 1000
#: Longest heartbeat expiry (and the heartbeat keys' own expiry), in milliseconds.
MAX_BEAT_TTL_MS = 600_000
#: Longest compaction lease, in milliseconds.
MAX_LEASE_MS = 600_000
#: Most (id, key, identity) triples one ``verify`` call checks.
MAX_VERIFY = 1024

#: Functions that write (called with ``FCALL``).
WRITE_FUNCTIONS = (
    "put_snapshot",
    "finish_round",
    "drop_snapshot",
    "lock",
    "unlock",
    "init_config",
    "xadd",
    "beat",
)
#: Functions that only read (called with ``FCALL_RO``).
READ_FUNCTIONS = ("read", "verify", "beats")

#: The Redis commands the functions run (a tenant's user needs each; see `tenant_acl_rules`).
WRITE_COMMANDS = (
    "del",
    "hset",
    "hsetnx",
    "hdel",
    "xadd",
    "xtrim",
    "zadd",
    "zrem",
    "pexpire",
)
READ_COMMANDS = (
    "hget",
    "hmget",
    "hgetall",
    "hvals",
    "hlen",
    "hstrlen",
    "hexists",
    "hscan",
    "exists",
    "xrange",
    "xrevrange",
    "xlen",
    "xinfo|stream",
    "zrangebyscore",
    "zscore",
    "zcard",
    "time",
)

_BODY = r"""
local LIB = '@LIB@'
local MAX_ENTRY = @MAX_ENTRY@
local MAX_BEAT = @MAX_BEAT@
local MAX_BEATS = @MAX_BEATS@
local MAX_TTL = @MAX_TTL@
local MAX_LEASE = @MAX_LEASE@
local MAX_VERIFY = @MAX_VERIFY@
local MAX_SHARDS = @MAX_SHARDS@

local function fail(msg) error({err = msg}) end

-- Every key of one tenant, each matching its Lua pattern (after the prefix).
local function check_keys(keys, kinds)
  if #keys ~= #kinds then fail('AGENTSPEC_KEYS expected ' .. #kinds .. ' keys') end
  local prefix
  for i, k in ipairs(keys) do
    local p, s = string.match(k, '^(agentspec:{[^{}]+}:)(.+)$')
    if not p or (prefix and p ~= prefix) or not string.match(s, kinds[i]) then
      fail('AGENTSPEC_KEYS not a key of the expected kind: ' .. string.sub(k, 1, 200))
    end
    prefix = p
  end
  return prefix
end

local function sid(s)
  local a, b = string.match(s, '^(%d+)-(%d+)$')
  if not a or #a > 15 or #b > 15 then fail('AGENTSPEC_ARGS not a stream id') end
  return tonumber(a), tonumber(b)
end
-- A stored mark that is not a stream id (damaged metadata) is never an error.
local function valid(s)
  return type(s) == 'string' and #s <= 40 and string.match(s, '^%d+%-%d+$') ~= nil
end
local function less(x, y)
  local a1, b1 = sid(x)
  local a2, b2 = sid(y)
  if a1 ~= a2 then return a1 < a2 end
  return b1 < b2
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int_arg(s, lo, hi, what)
  local n = string.match(s or '', '^%d+$') and tonumber(s)
  if not n or n < lo or n > hi then fail('AGENTSPEC_ARGS bad ' .. what) end
  return n
end
local function config_args(depth, budget)
  int_arg(depth, 1, 100000, 'depth')
  if budget ~= 'none' then int_arg(budget, 1, 1e15, 'budget') end
end

-- KEYS: snap, index.  ARGV: name, covered, mode, last_seen, data, key, gone.
local function put_snapshot(keys, args)
  local prefix = check_keys(keys, {'^snap:%x+$', '^shards$'})
  if keys[1] ~= prefix .. 'snap:' .. (args[1] or '') then
    fail('AGENTSPEC_ARGS the shard name does not match its key')
  end
  sid(args[2])
  local cur = redis.call('HGET', keys[1], 'covered')
  if not valid(cur) then cur = nil end  -- missing or damaged: rewritten by a put
  if cur and not less(cur, args[2]) then return 1 end
  if args[3] == 'bump' then
    if not cur or less(cur, args[4]) then return 0 end
    redis.call('HSET', keys[1], 'covered', args[2])
  elseif args[3] == 'put' and #args == 7 then
    redis.call('HSET', keys[1], 'covered', args[2], 'data', args[5], 'key', args[6],
               'gone', args[7], 'v', '1')
  else
    fail('AGENTSPEC_ARGS bad mode')
  end
  redis.call('HSET', keys[2], args[1], args[2])
  return 1
end

-- KEYS: snap, index.  ARGV: name, eviction entry id.  Deletes a shard's snapshot that
-- holds no more than the state before its eviction (a later one, of the shard written
-- again after it, stays).  Returns 1 when deleted.
local function drop_snapshot(keys, args)
  local prefix = check_keys(keys, {'^snap:%x+$', '^shards$'})
  if keys[1] ~= prefix .. 'snap:' .. (args[1] or '') then
    fail('AGENTSPEC_ARGS the shard name does not match its key')
  end
  sid(args[2])
  local cur = redis.call('HGET', keys[1], 'covered')
  if valid(cur) and not less(cur, args[2]) then return 0 end
  redis.call('DEL', keys[1])
  redis.call('HDEL', keys[2], args[1])
  return 1
end

-- KEYS: meta, index, stream.  ARGV: position.  Returns {trimmed id, entries removed}.
local function finish_round(keys, args)
  check_keys(keys, {'^meta$', '^shards$', '^log$'})
  sid(args[1])
  local round = redis.call('HGET', keys[1], 'round')
  if not valid(round) then round = nil end
  if not round or less(round, args[1]) then
    if round then redis.call('HSET', keys[1], 'prev', round) end
    redis.call('HSET', keys[1], 'round', args[1])
  end
  local low = redis.call('HGET', keys[1], 'prev')
  local trimmed = redis.call('HGET', keys[1], 'trimmed')
  if not valid(trimmed) then trimmed = nil end
  if not valid(low) then return {trimmed or '0-0', 0} end
  if trimmed and not less(trimmed, low) then return {trimmed, 0} end
  local n = redis.call('XTRIM', keys[3], 'MINID', low)
  redis.call('HSET', keys[1], 'trimmed', low)
  return {low, n}
end

-- KEYS: meta, stream, index.  ARGV: position, count, max entry bytes, max batch bytes,
-- force (1: read even when the position is not backed).
-- Returns {backed, last generated id, length, entries, next id or nil, depth, budget,
-- snapshots indexed, epoch}; an entry is {id, {field, value, ...}}, or {id, size} when
-- over the entry limit (never fetched).
local function read(keys, args)
  check_keys(keys, {'^meta$', '^log$', '^shards$'})
  local pos = args[1]
  if pos ~= '0-0' then sid(pos) end
  local count = int_arg(args[2], 1, 100000, 'count')
  local max_entry = int_arg(args[3], 1, 1e15, 'entry limit')
  local max_batch = int_arg(args[4], 1, 1e15, 'batch limit')
  local function get(...)  -- damaged metadata (a key of the wrong type) reads as missing
    local ok, v = pcall(redis.call, ...)
    if ok and v then return v end
    return false
  end
  local indexed = get('HLEN', keys[3])
  if indexed == false then indexed = 1 end  -- unreadable: never taken for "gone"
  local epoch = get('HGET', keys[1], 'epoch')
  local backed = 0
  if pos == '0-0' then
    local trimmed = get('HGET', keys[1], 'trimmed')
    if not trimmed or trimmed == '0-0' then backed = 1 end
  elseif #redis.call('XRANGE', keys[2], pos, pos, 'COUNT', 1) > 0 then
    backed = 1
  end
  local depth = get('HGET', keys[1], 'depth')
  local budget = get('HGET', keys[1], 'budget')
  local shards = get('HGET', keys[1], 'shards')
  if redis.call('EXISTS', keys[2]) == 0 then
    return {backed, '0-0', 0, {}, false, depth, budget, indexed, epoch, shards}
  end
  local info = redis.call('XINFO', 'STREAM', keys[2])
  local head = '0-0'
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then head = info[i + 1] end
  end
  local out, total, start, nxt = {}, 0, '(' .. pos, false
  if backed == 1 or args[5] == '1' then
    while true do
      local e = redis.call('XRANGE', keys[2], start, '+', 'COUNT', 1)
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
  return {backed, head, redis.call('XLEN', keys[2]), out, nxt, depth, budget, indexed, epoch,
          shards}
end

-- KEYS: lock (the meta hash's 'lease' fields).  ARGV: token, ms.  Returns 1 when taken.
local function lock(keys, args)
  check_keys(keys, {'^compacting$'})
  if not string.match(args[1] or '', '^%w+$') or #args[1] > 64 then
    fail('AGENTSPEC_ARGS bad token')
  end
  local ms = int_arg(args[2], 1, MAX_LEASE, 'lease')
  local now = now_ms()
  local held = redis.call('HMGET', keys[1], 'token', 'until')
  if held[1] and held[2] and tonumber(held[2]) and tonumber(held[2]) > now then return 0 end
  redis.call('HSET', keys[1], 'token', args[1], 'until', tostring(now + ms))
  redis.call('PEXPIRE', keys[1], ms)
  return 1
end

-- KEYS: lock.  ARGV: token.
local function unlock(keys, args)
  check_keys(keys, {'^compacting$'})
  if redis.call('HGET', keys[1], 'token') == args[1] then
    return redis.call('HDEL', keys[1], 'token', 'until')
  end
  return 0
end

-- KEYS: meta.  ARGV: depth, budget.  Returns {depth, budget} as stored.
local function init_config(keys, args)
  check_keys(keys, {'^meta$'})
  config_args(args[1], args[2])
  redis.call('HSETNX', keys[1], 'depth', args[1])
  redis.call('HSETNX', keys[1], 'budget', args[2])
  if args[3] then
    int_arg(args[3], 1, MAX_SHARDS, 'shard cap')
    redis.call('HSETNX', keys[1], 'shards', args[3])
  end
  return redis.call('HMGET', keys[1], 'depth', 'budget', 'shards')
end

-- KEYS: meta, stream.  ARGV: depth, budget, then the entry's field / value pairs.
local function xadd(keys, args)
  check_keys(keys, {'^meta$', '^log$'})
  config_args(args[1], args[2])
  if #args == 6 and args[3] == 'v' and args[4] == 'x' and args[5] == 'k' then
    -- An eviction entry: the shard key only (at most three components).
    if #args[6] > 4096 then fail('AGENTSPEC_ENTRY the eviction entry is too large') end
    return redis.call('XADD', keys[2], '*', 'v', 'x', 'k', args[6])
  end
  if #args ~= 10 then fail('AGENTSPEC_ENTRY an entry has the fields v, k, i, d') end
  local seen, size = {}, 0
  for n = 3, 10, 2 do
    local f = args[n]
    if (f ~= 'v' and f ~= 'k' and f ~= 'i' and f ~= 'd') or seen[f] then
      fail('AGENTSPEC_ENTRY an entry has the fields v, k, i, d')
    end
    seen[f] = true
    size = size + #f + #args[n + 1]
  end
  if size > MAX_ENTRY then fail('AGENTSPEC_ENTRY the entry is over ' .. MAX_ENTRY .. ' bytes') end
  redis.call('HSETNX', keys[1], 'depth', args[1])
  redis.call('HSETNX', keys[1], 'budget', args[2])
  local depth = redis.call('HGET', keys[1], 'depth')
  if depth ~= args[1] then
    return redis.error_reply('AGENTSPEC_CONFIG the tenant depth is ' .. depth)
  end
  return redis.call('XADD', keys[2], '*', unpack(args, 3))
end

-- KEYS: meta, stream.  ARGV: (stream id, key JSON, identity) triples.
local function verify(keys, args)
  check_keys(keys, {'^meta$', '^log$'})
  if #args % 3 ~= 0 or #args > 3 * MAX_VERIFY then fail('AGENTSPEC_ARGS bad verify arguments') end
  local trimmed = redis.call('HGET', keys[1], 'trimmed')
  if not valid(trimmed) then trimmed = '0-0' end
  local out = {}
  for n = 1, #args, 3 do
    local ok = 0
    sid(args[n])
    local e = redis.call('XRANGE', keys[2], args[n], args[n], 'COUNT', 1)
    if #e > 0 then
      local f, k, i = e[1][2], nil, nil
      for j = 1, #f, 2 do
        if f[j] == 'k' then k = f[j + 1] elseif f[j] == 'i' then i = f[j + 1] end
      end
      if k == args[n + 1] and i == args[n + 2] then ok = 1 end
    elseif less(args[n], trimmed) then
      ok = 1
    end
    out[#out + 1] = ok
  end
  return out
end

local function beat_id(s)
  if not string.match(s or '', '^[%w_%-]+$') or #s > 64 then
    fail('AGENTSPEC_ARGS bad subscriber id')
  end
end

-- KEYS: records (hash), expiry (zset).  ARGV: id, record ('' removes it), ttl ms.
local function beat(keys, args)
  check_keys(keys, {'^sub:records$', '^sub:expiry$'})
  beat_id(args[1])
  local now = now_ms()
  -- Bounded pruning: expired ids, then one HSCAN step for records without a live expiry
  -- or over the size limit (the cursor lives in the expiry set under the member '').
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', keys[2], '-inf', now, 'LIMIT', 0, 65)) do
    if id ~= '' then
      redis.call('HDEL', keys[1], id)
      redis.call('ZREM', keys[2], id)
    end
  end
  local cursor = redis.call('ZSCORE', keys[2], '') or '0'
  local step = redis.call('HSCAN', keys[1], string.format('%d', tonumber(cursor)), 'COUNT', 32)
  for j = 1, #step[2], 2 do
    local id = step[2][j]
    local exp = redis.call('ZSCORE', keys[2], id)
    if id == '' or not exp or tonumber(exp) <= now
       or redis.call('HSTRLEN', keys[1], id) > MAX_BEAT then
      redis.call('HDEL', keys[1], id)
      if id ~= '' then redis.call('ZREM', keys[2], id) end
    end
  end
  redis.call('ZADD', keys[2], tonumber(step[1]), '')
  if args[2] == '' then
    redis.call('HDEL', keys[1], args[1])
    redis.call('ZREM', keys[2], args[1])
    return 1
  end
  if #args[2] > MAX_BEAT then
    fail('AGENTSPEC_ARGS the heartbeat is over ' .. MAX_BEAT .. ' bytes')
  end
  local ttl = int_arg(args[3], 1, MAX_TTL, 'ttl')
  if redis.call('HEXISTS', keys[1], args[1]) == 0 and
     math.max(redis.call('HLEN', keys[1]), redis.call('ZCARD', keys[2]) - 1) >= MAX_BEATS then
    fail('AGENTSPEC_FULL the tenant has ' .. MAX_BEATS .. ' heartbeat records')
  end
  redis.call('HSET', keys[1], args[1], args[2])
  redis.call('ZADD', keys[2], now + ttl, args[1])
  redis.call('PEXPIRE', keys[1], MAX_TTL)
  redis.call('PEXPIRE', keys[2], MAX_TTL)
  return 1
end

-- KEYS: records, expiry.  ARGV: most records.  Returns {now, then id, kind, value...}:
-- kind 'r': value is the record; kind 'big': value is its size (not fetched).
local function beats(keys, args)
  check_keys(keys, {'^sub:records$', '^sub:expiry$'})
  local limit = int_arg(args[1], 1, MAX_BEATS, 'limit')
  local now = now_ms()
  local out = {tostring(now)}
  local live = redis.call('ZRANGEBYSCORE', keys[2], '(' .. now, '+inf', 'LIMIT', 0, limit)
  for _, id in ipairs(live) do
    if id ~= '' then
      local n = redis.call('HSTRLEN', keys[1], id)
      if n > MAX_BEAT then
        out[#out + 1] = id; out[#out + 1] = 'big'; out[#out + 1] = tostring(n)
      elseif n > 0 then
        out[#out + 1] = id; out[#out + 1] = 'r'; out[#out + 1] = redis.call('HGET', keys[1], id)
      end
    end
  end
  return out
end

local function reg(name, fn, ro)
  local spec = {function_name = LIB .. '_' .. name, callback = fn}
  if ro then spec.flags = {'no-writes'} end
  redis.register_function(spec)
end
reg('put_snapshot', put_snapshot)
reg('finish_round', finish_round)
reg('drop_snapshot', drop_snapshot)
reg('read', read, true)
reg('lock', lock)
reg('unlock', unlock)
reg('init_config', init_config)
reg('xadd', xadd)
reg('verify', verify, true)
reg('beat', beat)
reg('beats', beats, true)
"""

#: The library's source, for ``FUNCTION LOAD``.
LIBRARY = f"#!lua name={LIBRARY_NAME}\n" + (
    _BODY.replace("@LIB@", LIBRARY_NAME)
    .replace("@MAX_ENTRY@", str(MAX_ENTRY))
    .replace("@MAX_BEAT@", str(MAX_BEAT))
    .replace("@MAX_SHARDS@", str(1 << 20))
    .replace("@MAX_BEATS@", str(MAX_BEATS))
    .replace("@MAX_TTL@", str(MAX_BEAT_TTL_MS))
    .replace("@MAX_LEASE@", str(MAX_LEASE_MS))
    .replace("@MAX_VERIFY@", str(MAX_VERIFY))
)
