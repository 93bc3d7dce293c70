"""Crashes and concurrent processes never leave a manifest whose blocks are missing, and
collect() deletes exactly the blocks no manifest lists: killed writers, randomized
store/remove/collect interleavings across two processes, and collect racing writes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import store_worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foretell_blockstore import manifest as mf

WORKER = Path(store_worker.__file__)
BLOCK_TOKENS = 4


def worker(mode: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(root), str(BLOCK_TOKENS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=WORKER.parent)


def ask(proc: subprocess.Popen, **op):
    proc.stdin.write(json.dumps(op) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"worker died (exit {proc.poll()})"
    return json.loads(line)["result"]


def referenced(layout) -> dict[str, list[str]]:
    """Every manifest on disk -> the block ids it lists (each manifest must parse)."""
    listed = {}
    for path in sorted(layout.entries_dir.glob("*.safetensors")):
        listed[path.stem] = [ref.id for ref in mf.parse(path.read_bytes()).blocks]
    return listed


def block_ids(layout) -> set[str]:
    return {p.name[:-4] for p in layout.data_dir.glob("*.blk")} if layout.data_dir.exists() else set()


def assert_every_manifest_is_whole_and_correct(layout) -> dict[str, list[str]]:
    listed = referenced(layout)
    assert {b for ids in listed.values() for b in ids} <= block_ids(layout)
    for header in layout.scan():
        got = layout.read(header.key)
        want = store_worker.entry(list(header.tokens))
        assert got is not None, f"entry {header.key} is not servable"
        for have, expect in zip(got.layers, want.layers):
            for name, array in expect.tensors.items():
                assert (have.tensors[name].__array__() == array).all()
    assert len(layout.scan()) == len(listed)
    return listed


def test_killing_a_writer_never_leaves_a_manifest_with_missing_blocks(tmp_path):
    layout = store_worker.open_layout(str(tmp_path), BLOCK_TOKENS)
    killer = worker("killer", tmp_path)
    rng = random.Random(1234)
    interrupted = 0
    try:
        for kill in range(60):
            killer.stdin.write(f"go {kill} {rng.uniform(0, 150):.2f}\n")
            killer.stdin.flush()
            assert killer.stdout.readline().strip() == "killed"
            interrupted += bool(list(layout.directory.rglob("*.tmp")))  # before scan reaps
            listed = referenced(layout)  # every manifest parses...
            live = {b for ids in listed.values() for b in ids}
            assert live <= block_ids(layout)  # ...and every block it lists is there
            if kill % 6 == 5:
                assert_every_manifest_is_whole_and_correct(layout)
                layout.collect()
                assert block_ids(layout) == live  # only unreferenced blocks went
                assert not list(layout.directory.rglob("*.tmp"))
                assert referenced(layout) == listed
    finally:
        killer.stdin.close()
        killer.wait(timeout=30)
    # The kills really landed inside writes (a block or manifest half written).
    assert interrupted >= 5 and len(referenced(layout)) >= 10


ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.sampled_from("AB"), st.integers(0, 2), st.integers(1, 24)),
        st.tuples(st.just("remove"), st.sampled_from("AB"), st.integers(0, 2), st.integers(1, 24)),
        st.tuples(st.just("collect"), st.sampled_from("AB"), st.just(0), st.just(0)),
    ),
    min_size=1, max_size=14)


@pytest.fixture(scope="module")
def second_process(tmp_path_factory):
    proc = worker("ops", tmp_path_factory.mktemp("unused"))
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_interleaved_store_remove_collect_in_two_processes_keep_exactly_the_live_blocks(
        ops, tmp_path_factory, second_process):
    root = tmp_path_factory.mktemp("shared")
    mine = store_worker.open_layout(str(root), BLOCK_TOKENS)
    ask(second_process, op="root", root=str(root))
    live: set[tuple[int, int]] = set()
    for op, actor, prefix, length in ops:
        if actor == "A":
            tokens = store_worker.tokens_of(prefix, length)
            if op == "write":
                assert mine.write(store_worker.entry(tokens))
            elif op == "remove":
                mine.remove(mine.key_for(tokens))
            else:
                mine.collect()
        else:
            result = ask(second_process, op=op, prefix=prefix, length=length)
            assert result is True or op != "write"
        if op == "write":
            live.add((prefix, length))
        elif op == "remove":
            live.discard((prefix, length))
        # Never a live block deleted: every live entry is whole and correct after each op.
        listed = assert_every_manifest_is_whole_and_correct(mine)
        assert len(listed) == len(live)
    mine.collect()
    listed = referenced(mine)
    assert block_ids(mine) == {b for ids in listed.values() for b in ids}  # nothing leaked
    assert not list(mine.directory.rglob("*.tmp"))


def test_collect_racing_writes_in_another_process_never_takes_their_blocks(tmp_path):
    layout = store_worker.open_layout(str(tmp_path), BLOCK_TOKENS)
    collector = worker("ops", tmp_path)
    stop = tmp_path / "stop"
    try:
        collector.stdin.write(json.dumps({"op": "collect-loop", "until": str(stop)}) + "\n")
        collector.stdin.flush()
        rng = random.Random(7)
        written = []
        for _ in range(60):
            tokens = store_worker.tokens_of(rng.randrange(3), rng.randint(1, 40))
            assert layout.write(store_worker.entry(tokens))
            written.append(tokens)
            if rng.random() < 0.4:
                layout.remove(layout.key_for(rng.choice(written)))
            time.sleep(rng.uniform(0.005, 0.02))  # gaps in which the collector gets the lock
        stop.touch()
        rounds = json.loads(collector.stdout.readline())["result"]
    finally:
        collector.stdin.close()
        collector.wait(timeout=30)
    assert rounds > 5  # the collector really ran alongside the writes
    assert_every_manifest_is_whole_and_correct(layout)
    layout.collect()
    listed = referenced(layout)
    assert block_ids(layout) == {b for ids in listed.values() for b in ids}


def test_opening_a_tier_under_a_smaller_cap_frees_the_evicted_entries_blocks(
        layout, codecs, identity, tmp_path):
    """Entries another process left beyond this tier's cap (or a cap lowered since) are
    evicted as the tier opens, and their blocks deleted then, not at some later write: the
    directory holds no more than the cap once the tier is open."""
    from blockfill import block_files, kv_of, sizes

    from foretell.cache.tier import CacheTier
    from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

    def reopened():
        return BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=BLOCK_TOKENS),
                                identity=identity)

    first = CacheTier(codecs, layout=reopened())
    for i in range(4):  # no two share a block
        first.store(range(100 * i, 100 * i + 12), kv_of(list(range(100 * i, 100 * i + 12))))
    assert first.flush(10).durable
    first.close()
    one_entry = layout.bytes() // 4
    tier = CacheTier(codecs, layout=reopened(), ssd_bytes=2 * one_entry + one_entry // 2)
    try:
        assert len(tier.ssd.entries()) == 2
        on_disk = sizes(layout, block_files(layout))
        assert on_disk <= tier.ssd.max_bytes
        assert on_disk == sum(ref.nbytes for i in tier.ssd.layout._indexed()
                              for ref in i.blocks)
    finally:
        tier.close()
