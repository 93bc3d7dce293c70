"""The SSD index's lookup (``SsdIndex.find``, ``covers``, a write's supersession) looks at
the prompt's neighbours in token order and answers exactly what a scan of every indexed
entry answers: the same entry and length, the first in the index's order among equals."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from cachefill import filled_kv, filled_rotating

from foretell.cache import prefix as prefix_module
from foretell.cache import ssd as ssd_module
from foretell.cache.attachment import ATTACHMENT_PROVIDER, DraftAttachmentCodec
from foretell.cache.codecs import snapshot_entry
from foretell.cache.prefix import can_serve, match_rank, usable_length
from foretell.cache.ssd import SsdIndex
from foretell.store.entry import EntryHeader, LayerHeader
from foretell.store.single_file import SingleFileLayout

FAKE_PROVIDER = "tests/reuse-facts@1"


class FactsCodec:
    """A stored layer's reuse facts, read from its meta as written (headers only)."""

    name = "reuse-facts"
    provider_id = FAKE_PROVIDER

    def header_trimmable(self, meta):
        return meta["trimmable"]

    def minimum_reusable_offset(self, meta):
        return meta["min_offset"]


FACT_CODECS = [FactsCodec(), DraftAttachmentCodec()]


def layers(trimmable, min_offset, attachment):
    found = [LayerHeader(codec="reuse-facts", provider=FAKE_PROVIDER,
                         meta={"trimmable": trimmable, "min_offset": min_offset})]
    if attachment is not None:
        found.append(LayerHeader(codec="draft-state", provider=ATTACHMENT_PROVIDER,
                                 meta={"identity": attachment}))
    return tuple(found)


@dataclass
class FakeEntry:
    """What ``SsdIndex.write`` and the fake layouts read of an entry."""

    tokens: tuple[int, ...]
    namespace: str
    tensor_bytes: int
    layers: tuple[LayerHeader, ...]


class MemoryLayout:
    """Headers in a dict. ``key_for`` is its own, but headers put by :meth:`place` (what
    another process stored) may carry any key: one state under two keys, a key whose
    tokens changed."""

    def __init__(self):
        self.stored: dict[str, EntryHeader] = {}
        self.damaged: set[str] = set()
        self.clock = 0

    def key_for(self, tokens, namespace=""):
        return f"{namespace}:{','.join(map(str, tokens))}"

    def place(self, key, tokens, namespace, facts, nbytes, last_used=None):
        self.clock += 1
        self.stored[key] = EntryHeader(key=key, tokens=tuple(tokens), namespace=namespace,
                                       layers=layers(*facts), nbytes=nbytes,
                                       last_used=self.clock if last_used is None else last_used)

    def write(self, entry):
        self.clock += 1
        key = self.key_for(entry.tokens, entry.namespace)
        self.stored[key] = EntryHeader(key=key, tokens=entry.tokens, namespace=entry.namespace,
                                       layers=entry.layers, nbytes=entry.tensor_bytes,
                                       last_used=self.clock)
        return True

    def read(self, key):
        return None if key in self.damaged or key not in self.stored else object()

    def scan(self):
        return sorted(self.stored.values(), key=lambda h: h.last_used)

    def headers(self):
        return self.scan()

    def remove(self, key):
        return self.stored.pop(key, None) is not None

    def collect(self):
        return 0

    def bytes(self):
        return sum(h.nbytes for h in self.stored.values())


class SharedMemoryLayout(MemoryLayout):
    """A layout several processes share (``FindsPrefixes``): a lookup learns from it."""

    def prefixes(self, prompt, namespace, beyond):
        found = [h for h in self.stored.values() if h.namespace == namespace
                 and prefix_module.common_prefix(prompt, h.tokens) > beyond]
        return sorted(found, key=lambda h: -len(h.tokens))


# -- the reference: a scan of every indexed entry, in the index's order ----------------------

def scanned(index):
    """Every indexed entry in the order the scan walked them (the index's own order)."""
    return list(index._index.values())


def linear_find(index, prompt, namespace, prefer):
    best, length, rank = None, 0, match_rank(0, ())
    for stored in scanned(index):
        if stored.header.namespace != namespace:
            continue
        n = usable_length(prompt, stored.tokens, trimmable=stored.trimmable,
                          min_offset=stored.min_offset)
        candidate = match_rank(n, stored.tokens, stored.attachment, prefer)
        if n > 0 and candidate > rank:
            best, length, rank = stored, n, candidate
    return best, length


def linear_covers(index, tokens, namespace, attached):
    return any(s.header.namespace == namespace and can_serve(
        s.tokens, trimmable=s.trimmable, min_offset=s.min_offset, old_tokens=tokens,
        old_attached=attached) for s in scanned(index))


def linear_write(indexed, stored, new, cap):
    """What a write of ``new`` leaves indexed and stored, from what was (``indexed``: the
    index in its order, ``stored``: the layout's headers), deciding with a scan of every
    entry: each one ``new`` can serve superseded, then the least recently used evicted to
    the cap."""
    key, indexed, stored = new.header.key, dict(indexed), dict(stored)
    indexed[key], stored[key] = new, new.header
    for old_key, old in list(indexed.items()):
        if old_key != key and old.header.namespace == new.header.namespace and can_serve(
                new.tokens, trimmable=new.trimmable, min_offset=new.min_offset,
                old_tokens=old.tokens, old_attached=old.attached):
            del indexed[old_key]
            stored.pop(old_key, None)
    for old in sorted(indexed.values(), key=lambda s: s.header.last_used):
        if sum(h.nbytes for h in stored.values()) <= cap:
            break
        if old.header.key != key:
            del indexed[old.header.key]
            stored.pop(old.header.key, None)
    return list(indexed), set(stored)


def assert_in_step(index):
    """The sorted index holds exactly the indexed entries, each under its namespace."""
    sorted_entries = {(ns, id(s)) for ns, entries in index._sorted.items()
                      for s in entries.entries}
    assert sorted_entries == {(s.header.namespace, id(s)) for s in scanned(index)}
    assert all(entries.keys == sorted(s.tokens for s in entries.entries)
               for entries in index._sorted.values())


def facts(stored):
    return None if stored is None else (stored.header.key, stored.tokens)


# -- random stores and prompts --------------------------------------------------------------

NAMESPACES, DRAFTERS = ["", "mtp"], [None, None, "d1", "d2"]


def random_tokens(rng, index):
    """Few token values and short sequences, so entries share prefixes, extend and
    supersede each other; often a cut or an extension of an entry already indexed."""
    held = scanned(index)
    if held and rng.random() < 0.6:
        base = list(rng.choice(held).tokens)
        base = base[:rng.randint(0, len(base))] if rng.random() < 0.5 else base
        return tuple(base + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))])
    return tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 8)))


def random_facts(rng):
    return rng.random() < 0.7, rng.choice([0, 0, 1, 2, 4]), rng.choice(DRAFTERS)


def random_step(rng, index):
    """One change to what the layout holds or the index knows."""
    layout, held, op = index.layout, scanned(index), rng.random()
    if op < 0.3:
        tokens = random_tokens(rng, index) or (0,)
        f = random_facts(rng)
        index.write(FakeEntry(tokens, rng.choice(NAMESPACES), rng.randint(1, 12), layers(*f)))
    elif op < 0.45:  # another process stores; under its own key now and then
        tokens, namespace = random_tokens(rng, index), rng.choice(NAMESPACES)
        key = layout.key_for(tokens, namespace)
        if rng.random() < 0.4:
            key = rng.choice([f"other-{rng.randint(0, 5)}", *[s.header.key for s in held]])
            if held and rng.random() < 0.5:  # a state indexed already, under another key
                tokens, namespace = rng.choice(held).tokens, rng.choice(held).header.namespace
        layout.place(key, tokens, namespace, random_facts(rng), rng.randint(1, 12),
                     last_used=rng.choice([None, 1.0, 2.0]))
    elif op < 0.55:
        index.scan()
    elif op < 0.65 and held:
        stored = rng.choice(held)
        index.touch(stored.tokens, stored.header.namespace)
    elif op < 0.75 and held:
        stored = rng.choice(held)
        if rng.random() < 0.3:
            layout.damaged.add(stored.header.key)
        index.read(stored)
    elif op < 0.85 and held:
        index.forget(rng.choice(held).header.key)
    elif held:
        index.remove(rng.choice(held).header.key)


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("probe_from", [1, prefix_module.LRU_PROBE_FROM])
@pytest.mark.parametrize("seed", range(25))
def test_lookups_choose_what_a_scan_of_every_entry_chooses(monkeypatch, seed, probe_from,
                                                           shared):
    monkeypatch.setattr(prefix_module, "LRU_PROBE_FROM", probe_from)
    rng = random.Random(seed)
    layout = SharedMemoryLayout() if shared else MemoryLayout()
    index = SsdIndex(layout, FACT_CODECS, max_bytes=60, rescan_s=float("inf"))
    index.scan()
    for _ in range(250):
        if rng.random() < 0.3:
            tokens = random_tokens(rng, index) or (0,)
            entry = FakeEntry(tokens, rng.choice(NAMESPACES), rng.randint(1, 12),
                              layers(*random_facts(rng)))
            indexed, stored = dict(index._index), dict(layout.stored)
            assert index.write(entry)
            new = index._index[layout.key_for(tokens, entry.namespace)]
            assert (list(index._index), set(layout.stored)) == linear_write(
                indexed, stored, new, index.cap())
        else:
            random_step(rng, index)
        assert_in_step(index)
        for _ in range(3):
            prompt, namespace = random_tokens(rng, index), rng.choice(NAMESPACES)
            prefer = rng.choice([*DRAFTERS, "d3"])
            found, length = index.find(prompt, namespace, prefer)
            expected, expected_length = linear_find(index, prompt, namespace, prefer)
            assert (facts(found), length) == (facts(expected), expected_length)
            tokens, attached = random_tokens(rng, index), rng.random() < 0.3
            assert (index.covers(tokens, namespace, attached=attached)
                    == linear_covers(index, tokens, namespace, attached))
        for namespace in NAMESPACES:
            assert index.in_namespace(namespace) == [
                s for s in index.entries() if s.header.namespace == namespace]


@pytest.mark.parametrize("attachment, prefer", [(None, None), ("d1", None), ("d1", "d1")])
def test_one_state_under_two_keys_serves_the_first_indexed_then_the_other(attachment, prefer):
    layout = MemoryLayout()
    for key in ("c", "b", "a"):
        layout.place(key, (1, 2, 3), "", (True, 0, attachment), 1)
    layout.place("z", (1, 2), "", (True, 0, attachment), 1)
    index = SsdIndex(layout, FACT_CODECS, max_bytes=1 << 20)
    index.scan()
    assert facts(index.find((1, 2, 3, 4), "", prefer)[0]) == ("c", (1, 2, 3))
    index.read(next(s for s in index.entries() if s.header.key == "b"))  # used: same place
    index.forget("c")
    assert facts(index.find((1, 2, 3, 4), "", prefer)[0]) == ("b", (1, 2, 3))
    index.forget("b")
    assert facts(index.find((1, 2, 3, 4), "", prefer)[0]) == ("a", (1, 2, 3))
    assert index.covers((1, 2), "") and not index.covers((1, 2, 4), "")


def test_a_key_that_comes_back_with_other_tokens_is_found_by_the_new_ones():
    layout = SharedMemoryLayout()
    index = SsdIndex(layout, FACT_CODECS, max_bytes=1 << 20)
    layout.place("k", (1, 2, 3), "", (True, 0, None), 1)
    index.scan()
    layout.place("k", (7, 8, 9), "mtp", (True, 0, None), 1)
    assert facts(index.find((7, 8, 9, 1), "mtp")[0]) == ("k", (7, 8, 9))
    assert index.find((1, 2, 3, 4), "") == (None, 0)
    assert_in_step(index)


def test_a_lookup_compares_the_prompt_with_its_neighbours_not_with_every_entry(counted):
    layout = MemoryLayout()
    for first in range(300):
        layout.place(layout.key_for((first, 1, 2, 3)), (first, 1, 2, 3), "", (True, 0, None), 1)
    index = SsdIndex(layout, FACT_CODECS, max_bytes=1 << 30)
    index.scan()
    compared = counted(prefix_module, "common_prefix")
    served = counted(ssd_module, "can_serve")
    assert facts(index.find((120, 1, 9), "")[0]) == (layout.key_for((120, 1, 2, 3)),
                                                     (120, 1, 2, 3))
    assert len(compared) <= 4
    assert index.covers((120, 1), "") and not index.covers((120, 2), "")
    assert len(served) == 1  # (120, 1, 2, 3) only: no entry begins with (120, 2)
    served.clear()
    index.write(FakeEntry((120, 1, 2, 3, 4), "", 1, layers(True, 0, None)))
    assert len(served) == 1  # the one entry the new one begins with
    assert layout.key_for((120, 1, 2, 3)) not in layout.stored


# -- through a real layout ------------------------------------------------------------------

def test_through_a_real_layout_lookups_choose_what_a_scan_chooses(tmp_path, identity, codecs):
    layout = SingleFileLayout(tmp_path, identity=identity)
    index = SsdIndex(layout, codecs, max_bytes=1 << 30)
    rng = random.Random(7)
    stored = [tuple(rng.randint(0, 2) for _ in range(rng.randint(2, 9))) for _ in range(24)]
    for i, tokens in enumerate(stored):
        ring = i % 3 == 0  # untrimmable past its window: serves only its own length
        caches = ([filled_kv(len(tokens)), filled_rotating(len(tokens), max_size=4)] if ring
                  else [filled_kv(len(tokens))])
        assert index.write(snapshot_entry(tokens, caches, codecs, namespace=f"ns{i % 2}"))
    reopened = SsdIndex(SingleFileLayout(tmp_path, identity=identity), codecs,
                        max_bytes=1 << 30)
    reopened.scan()
    assert len(reopened.entries()) >= 8
    for probe in index, reopened:
        assert_in_step(probe)
        for _ in range(200):
            prompt = tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 11)))
            namespace = rng.choice(["ns0", "ns1"])
            found, length = probe.find(prompt, namespace)
            expected, expected_length = linear_find(probe, prompt, namespace, None)
            assert (facts(found), length) == (facts(expected), expected_length)
            assert probe.covers(prompt, namespace) == linear_covers(probe, prompt, namespace,
                                                                    False)
