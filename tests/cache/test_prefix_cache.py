"""The RAM prefix cache: longest usable prefix capped at len(prompt) - 1, zero-copy clones
that never change the donor, supersession only by entries that can serve the ancestor
(the restart-0 defect), and a byte cap."""

from __future__ import annotations

import random

import numpy as np
import pytest
from cachefill import feed, filled_kv, filled_rotating
from hypothesis import given
from hypothesis import strategies as st

from foretell.cache import prefix as prefix_module
from foretell.cache.prefix import (
    PrefixCache,
    PrefixEntry,
    can_serve,
    common_prefix,
    match_rank,
    usable_length,
)
from foretell.model.kvcache import KVCache

WINDOW = 16


def host(a):
    return np.asarray(a)


def kv_entry(n):
    return [filled_kv(n)]


def ring_entry(n):
    return [filled_kv(n), filled_rotating(n, max_size=WINDOW)]


@pytest.fixture
def ram(codecs):
    return PrefixCache(codecs, max_bytes=1 << 30)


def test_an_identical_prompt_reuses_all_but_its_last_token(ram):
    ram.put(range(20), kv_entry(20))
    caches, n = ram.lookup(list(range(20)))
    assert n == 19 and caches[0].offset == 19


def test_the_longest_usable_prefix_wins(ram):
    ram.put(range(5), kv_entry(5))
    ram.put([*range(12), 99], kv_entry(13))
    caches, n = ram.lookup([*range(12), 7, 8])
    assert n == 12 and caches[0].offset == 12


def test_a_clone_trimmed_to_the_match_holds_the_donors_values(ram):
    donor = kv_entry(20)
    ram.put(range(20), donor)
    caches, n = ram.lookup([*range(10), 55, 56])
    assert n == 10
    np.testing.assert_array_equal(host(caches[0].state[0]), host(donor[0].state[0][..., :10, :]))


def test_extending_a_handed_out_clone_never_changes_the_stored_entry(ram):
    ram.put(range(20), kv_entry(20))
    stored = host(ram.entries()[0].caches[0].state[0])
    caches, _ = ram.lookup([*range(10), 55, 56])
    feed(caches[0], 30, seed=7)
    again, n = ram.lookup([*range(20), 1])
    assert n == 20
    np.testing.assert_array_equal(host(again[0].state[0]), stored)


def test_the_callers_caches_going_on_never_change_the_stored_entry(ram):
    caches = kv_entry(20)
    ram.put(range(20), caches)
    stored = host(ram.entries()[0].caches[0].state[0])
    caches[0].trim(5)
    feed(caches[0], 5, seed=9)
    np.testing.assert_array_equal(host(ram.entries()[0].caches[0].state[0]), stored)


def test_a_wrapped_ring_serves_only_its_exact_length(ram):
    ram.put(range(20), ring_entry(20))  # 20 tokens through a 16-token window: wrapped
    assert ram.lookup([*range(15), 99])[1] == 0
    assert ram.lookup([*range(20), 99])[1] == 20


def test_restart_0_an_untrimmable_longer_entry_never_displaces_the_prompt_snapshot(ram):
    prompt = list(range(12))
    ram.put(prompt, ring_entry(12))  # the prompt snapshot, inside the window: trimmable
    ram.put([*prompt, *range(100, 108)], ring_entry(20))  # prompt + reply: wrapped
    assert len(ram) == 2
    # The next turn re-encodes the reply differently: only the snapshot can serve it.
    caches, n = ram.lookup([*prompt, 100, 555, 556])
    assert n == 12 and [c.offset for c in caches] == [12, 12]


def test_restart_0_an_untrimmable_longer_entry_never_outranks_a_usable_one(ram):
    ram.put([*range(20)], ring_entry(20))
    ram.put(range(10), ring_entry(10))
    assert ram.lookup([*range(14), 99])[1] == 10


def test_a_trimmable_longer_entry_supersedes_its_ancestors(ram):
    ram.put(range(8), kv_entry(8))
    ram.put(range(16), kv_entry(16))
    assert [e.tokens for e in ram.entries()] == [tuple(range(16))]
    assert ram.lookup([*range(8), 99])[1] == 8


def test_an_exact_duplicate_is_replaced_even_when_untrimmable(ram):
    ram.put(range(20), ring_entry(20))
    ram.put(range(20), ring_entry(20))
    assert len(ram) == 1


def test_namespaces_never_serve_each_other(ram):
    ram.put(range(10), kv_entry(10), namespace="mtp/plain")
    assert ram.lookup([*range(10), 1], namespace="plain/plain")[1] == 0
    assert ram.lookup([*range(10), 1], namespace="mtp/plain")[1] == 10


def exact_entry(n):
    """A cache whose buffers hold exactly its ``n`` tokens (no slack past them)."""
    cache = filled_kv(n)
    return [KVCache.from_state(cache.state, cache.meta)]


def test_the_byte_cap_evicts_least_recently_used_by_bytes(codecs):
    size = PrefixCache(codecs, 1 << 30)
    size.put(range(100, 110), exact_entry(10))
    unit = size.bytes()
    ram = PrefixCache(codecs, max_bytes=3 * unit)
    ram.put(range(0, 10), exact_entry(10))       # oldest
    ram.put(range(20, 30), exact_entry(10))
    ram.lookup([*range(0, 10), 1])             # the oldest becomes the most recent
    ram.put(range(40, 60), exact_entry(20))       # two units: one entry must go
    kept = {e.tokens[0] for e in ram.entries()}
    assert kept == {0, 40} and ram.bytes() <= ram.max_bytes


def test_the_cap_counts_the_buffers_an_entry_keeps_alive_not_only_its_tokens(codecs):
    # A cache grown in steps (256 tokens; 1,024 after fixed-shape forwards on CUDA) leaves
    # slots past its tokens; the stored clones are views that keep the whole buffer alive.
    cache = filled_kv(10)
    assert cache.nbytes > 10 * cache.nbytes // cache.keys.shape[2]  # slack past the tokens
    ram = PrefixCache(codecs, 1 << 30)
    ram.put(range(10), [cache])
    assert ram.bytes() == cache.nbytes
    assert PrefixCache(codecs, max_bytes=cache.nbytes - 1).put(range(10), [cache]) is False


def test_an_entry_larger_than_the_cap_is_not_kept(codecs):
    ram = PrefixCache(codecs, max_bytes=100)
    assert ram.put(range(10), kv_entry(10)) is False and len(ram) == 0


def test_caches_that_do_not_hold_the_tokens_are_refused(ram):
    with pytest.raises(ValueError, match="tokens"):
        ram.put(range(9), kv_entry(10))


@pytest.mark.parametrize("prompt,tokens,trimmable,floor,expected", [
    ([1, 2, 3], [1, 2, 3], True, 0, 2),       # capped at len - 1
    ([1, 2, 3, 4], [1, 2, 3], False, 3, 3),    # exact entry, untrimmable: fine
    ([1, 2, 9, 9], [1, 2, 3], False, 3, 0),    # would need a trim
    ([1, 2, 9, 9], [1, 2, 3], True, 3, 0),     # below the minimum reusable offset
    ([1, 2, 9, 9], [1, 2, 3], True, 2, 2),
    ([9, 2, 3], [1, 2, 3], True, 0, 0),
])
def test_usable_length(prompt, tokens, trimmable, floor, expected):
    assert usable_length(prompt, tokens, trimmable=trimmable, min_offset=floor) == expected


def test_can_serve_requires_a_prefix_and_a_trim_that_reaches_it():
    assert can_serve([1, 2, 3], trimmable=True, min_offset=0, old_tokens=[1, 2])
    assert not can_serve([1, 2, 3], trimmable=False, min_offset=3, old_tokens=[1, 2])
    assert not can_serve([1, 2, 3], trimmable=True, min_offset=3, old_tokens=[1, 2])
    assert can_serve([1, 2, 3], trimmable=False, min_offset=3, old_tokens=[1, 2, 3])
    assert not can_serve([1, 5, 3], trimmable=True, min_offset=0, old_tokens=[1, 2])


def test_an_empty_prompt_tail_gets_nothing(ram):
    ram.put(range(10), kv_entry(10))
    assert ram.lookup([0])[1] == 0


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_counts_the_shared_leading_tokens(a, b):
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_prefix(a, tuple(b)) == expected


# -- the sorted lookup against a scan of every entry ----------------------------------------

class LinearCache:
    """The reference: every lookup scans every entry, least recently used first, and the
    first of the best rank wins; storing scans every entry for the ones it serves."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.held = []  # least recently used first
        self.evictions = 0

    def best(self, prompt, namespace, prefer):
        best, length, rank = None, 0, match_rank(0, ())
        for entry in self.held:
            if entry.namespace != namespace:
                continue
            n = entry.usable(tuple(prompt))
            candidate = match_rank(n, entry.tokens, entry.attachment, prefer)
            if n > 0 and candidate > rank:
                best, length, rank = entry, n, candidate
        return best, length

    def touch(self, entry):
        self.held.remove(entry)
        self.held.append(entry)

    def exact(self, tokens, namespace):
        for entry in self.held:
            if entry.namespace == namespace and entry.tokens == tuple(tokens):
                self.touch(entry)
                return True
        return False

    def hold(self, entry):
        if entry.nbytes > self.max_bytes:
            return False
        self.held = [old for old in self.held if not entry.serves(old)] + [entry]
        while sum(e.nbytes for e in self.held) > self.max_bytes:
            self.held.pop(0)
            self.evictions += 1
        return True


def facts(entry):
    return None if entry is None else (entry.namespace, entry.tokens)


def random_tokens(rng, held):
    """Few token values and short sequences, so entries share prefixes, extend and
    supersede each other; often a cut or an extension of an entry already held."""
    if held and rng.random() < 0.6:
        base = list(rng.choice(held).tokens)
        base = base[:rng.randint(0, len(base))] if rng.random() < 0.5 else base
        return tuple(base + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))])
    return tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("probe_from", [1, prefix_module.LRU_PROBE_FROM])
@pytest.mark.parametrize("seed", range(40))
def test_lookups_choose_what_a_scan_of_every_entry_chooses(codecs, monkeypatch, seed, probe_from):
    monkeypatch.setattr(prefix_module, "LRU_PROBE_FROM", probe_from)
    rng = random.Random(seed)
    ram, reference = PrefixCache(codecs, max_bytes=60), LinearCache(max_bytes=60)
    namespaces, drafters = ["", "mtp"], [None, None, "d1", "d2"]
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            tokens = random_tokens(rng, reference.held) or (0,)
            fields = dict(tokens=tokens, namespace=rng.choice(namespaces), caches=[],
                          nbytes=rng.randint(1, 12), trimmable=rng.random() < 0.7,
                          min_offset=rng.choice([0, 0, 1, 2, 4]),
                          attachment=rng.choice(drafters))
            assert ram.hold(PrefixEntry(**fields)) == reference.hold(PrefixEntry(**fields))
        elif op < 0.9:
            prompt, namespace = random_tokens(rng, reference.held), rng.choice(namespaces)
            prefer = rng.choice([*drafters, "d3"])
            entry, length = ram.best(prompt, namespace, prefer)
            expected, expected_length = reference.best(prompt, namespace, prefer)
            assert (facts(entry), length) == (facts(expected), expected_length)
            if entry is not None and rng.random() < 0.5:
                ram.take(entry, length)
                reference.touch(expected)
        else:
            tokens, namespace = random_tokens(rng, reference.held), rng.choice(namespaces)
            assert ram.exact(tokens, namespace) == reference.exact(tokens, namespace)
        assert [facts(e) for e in ram.entries()] == [facts(e) for e in reference.held]
        assert ram.bytes() == sum(e.nbytes for e in reference.held)
        assert ram.evictions == reference.evictions


def held_entry(tokens):
    return PrefixEntry(tokens=tokens, namespace="", caches=[], nbytes=1, trimmable=True,
                       min_offset=0)


def test_a_lookup_compares_the_prompt_with_its_neighbours_not_with_every_entry(
        codecs, monkeypatch, counted):
    monkeypatch.setattr(prefix_module, "LRU_PROBE_FROM", 1000)
    ram = PrefixCache(codecs, max_bytes=1 << 30)
    for first in range(200):
        ram.hold(held_entry((first, 1, 2, 3)))
    for second in range(100):  # all tied at one token for the prompt below
        ram.hold(held_entry((500, second)))
    compared = counted(prefix_module, "common_prefix")
    entry, length = ram.best((120, 1, 9), "")
    assert (entry.tokens, length) == ((120, 1, 2, 3), 2)
    assert len(compared) <= 4
    compared.clear()
    entry, length = ram.best((500, 1000, 9), "")
    assert (entry.tokens, length) == ((500, 0), 1)  # the least recently used of the tie
    assert len(compared) <= 4


def test_a_long_tie_is_looked_for_in_the_lru_order_first(codecs, counted):
    ram = PrefixCache(codecs, max_bytes=1 << 30)
    for second in range(100):  # one system prompt, then each its own conversation
        ram.hold(held_entry((500, 7, second)))
    for first in range(100):
        ram.hold(held_entry((first, 1, 2, 3)))
    ram.take(ram.best((500, 7, 0, 1), "")[0], 3)  # the oldest becomes the most recent
    weighed = counted(prefix_module, "usable_match")
    entry, length = ram.best((500, 7, 1000, 9), "")
    assert (entry.tokens, length) == ((500, 7, 1), 2)
    assert len(weighed) == 1
