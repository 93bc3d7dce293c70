"""The Lua scripts the ``redis`` layout runs on the server. A script runs atomically: no other
client's command lands between its steps, which is what makes publication all-or-nothing
without a lock (docs in the layout's module). Keys are declared in ``KEYS`` except where a
script follows a pointer to a key it cannot know beforehand (:data:`LOOKUP`): the layout is
for one server (or a primary), not a cluster.
"""

#: Mark blocks as being written and say which are not stored yet.
#: KEYS[1] loose (sorted set), KEYS[2..] block keys; ARGV[1..] the blocks' ids.
#: Returns the ids of the blocks not stored. Marking each block loose at the server's time
#: keeps ``collect`` off it for its grace period, however old it is: a writer that found it
#: stored is about to list it.
TOUCH = """
local now = redis.call('TIME')[1]
local missing = {}
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[1], now, ARGV[i - 1])
  if redis.call('EXISTS', KEYS[i]) == 0 then missing[#missing + 1] = ARGV[i - 1] end
end
return missing
"""

#: Publish an entry whose blocks are all stored, or nothing.
#: KEYS[1] manifest, KEYS[2] entries, KEYS[3] digests, KEYS[4] loose, KEYS[5] identities,
#: KEYS[6 .. 5+np] pointers, KEYS[6+np ..] block keys;
#: ARGV[1] manifest bytes, ARGV[2] entry key, ARGV[3] np, ARGV[4] last use, ARGV[5] manifest
#: digest, ARGV[6] identity field, ARGV[7 ..] block ids (one per block key).
#: Returns the ids of blocks that are gone (collected or evicted since they were written):
#: then nothing was published, and the writer stores them again.
PUBLISH = """
local np = tonumber(ARGV[3])
local missing = {}
for i = 6 + np, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then missing[#missing + 1] = ARGV[i + 1 - np] end
end
if #missing > 0 then return missing end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[5])
for i = 6 + np, #KEYS do redis.call('ZREM', KEYS[4], ARGV[i + 1 - np]) end
for i = 6, 5 + np do redis.call('SET', KEYS[i], ARGV[2]) end
redis.call('HSET', KEYS[5], ARGV[6], ARGV[4])
return {}
"""

#: Unpublish an entry: its manifest, its listing, the pointers that still name it; its blocks
#: become loose (collectable once no manifest lists them).
#: KEYS[1] manifest, KEYS[2] entries, KEYS[3] digests, KEYS[4] loose, KEYS[5 ..] pointers;
#: ARGV[1] entry key, ARGV[2] the manifest bytes a reader judged damaged ('': whatever is
#: there), ARGV[3 ..] the ids of the blocks it listed.
#: Returns 1 if a manifest was deleted, 0 if none was there, -1 if it was rewritten since
#: it was judged (then it is kept: the new one is not at fault).
REMOVE = """
if ARGV[2] ~= '' then
  local now = redis.call('GET', KEYS[1])
  if now and now ~= ARGV[2] then return -1 end
end
local deleted = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
for i = 5, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
for i = 3, #ARGV do redis.call('ZADD', KEYS[4], 'NX', 0, ARGV[i]) end
return deleted
"""

#: The longest leading-blocks pointer set, and the manifest it names, in one round trip.
#: KEYS: pointer keys, longest prefix first; ARGV[1]: the manifest keys' prefix.
#: Returns {entry key, manifest bytes}, or {} when no pointer names a stored manifest.
LOOKUP = """
for i = 1, #KEYS do
  local key = redis.call('GET', KEYS[i])
  if key then
    local raw = redis.call('GET', ARGV[1] .. key)
    if raw then return {key, raw} end
  end
end
return {}
"""

#: Delete blocks no manifest lists, unless a writer marked them within the grace period.
#: KEYS[1] loose, KEYS[2..] block keys; ARGV[1] grace seconds, ARGV[2..] the blocks' ids.
#: Returns the bytes freed.
COLLECT = """
local cutoff = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
local freed = 0
for i = 2, #KEYS do
  local marked = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if (not marked) or tonumber(marked) <= cutoff then
    freed = freed + redis.call('STRLEN', KEYS[i])
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return freed
"""
