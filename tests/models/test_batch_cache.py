"""Batched KV caches: a forward over many rows, each its own sequence at its own length,
computes what each row computes alone (CPU, float32), through joins, ragged rollback,
leaving rows and a sliding window that wraps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from foretell.model import load_model
from foretell.model.batch import BatchKVCache, batch_caches
from foretell.plugin import load_plugins
from foretell.tools import make_model_dir

QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
GEMMA = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
         "sliding_window": 8, "sliding_window_pattern": 3}


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text"])
def model(request, tmp_path_factory):
    overrides = QWEN if request.param == "qwen3" else GEMMA
    path = make_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                          overrides=overrides, seed=0)
    return load_model(path, load_plugins().registry)


def alone(model, tokens: list[int]) -> tuple[list, mx.array]:
    """Caches after ``tokens[:-1]`` fed one chunk, and the logits of one step on the last."""
    caches = model.make_caches()
    if len(tokens) > 1:
        model.forward(mx.array([tokens[:-1]]), caches)
    hidden, _ = model.forward(mx.array([tokens[-1:]]), caches)
    return caches, model.logits(hidden)[0, -1]


def prefilled(model, tokens: list[int]) -> list:
    caches = model.make_caches()
    model.forward(mx.array([tokens]), caches)
    mx.eval([c.state for c in caches])
    return caches


def close(a: mx.array, b: mx.array) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def rows_join(model, prompts: list[list[int]]) -> list[BatchKVCache]:
    batch = batch_caches(model)
    for layer, _ in enumerate(batch):
        batch[layer].append([prefilled(model, p[:-1])[layer] for p in prompts])
    return batch


PROMPTS = [[5, 9, 13, 2, 7, 7, 1, 30, 22, 4, 8], [3, 1, 4], [11, 12, 13, 14, 15, 16, 17]]


def test_a_decode_step_over_rows_of_different_lengths_matches_each_row_alone(model):
    batch = rows_join(model, PROMPTS)
    hidden, _ = model.forward(mx.array([[p[-1]] for p in PROMPTS]), batch)
    logits = model.logits(hidden)[:, -1]
    for row, prompt in enumerate(PROMPTS):
        close(logits[row], alone(model, prompt)[1])


def test_many_decode_steps_past_the_window_match_each_row_alone(model):
    batch = rows_join(model, PROMPTS)
    sequences = [list(p) for p in PROMPTS]
    for _ in range(12):  # past gemma's window of 8 for every row
        hidden, _ = model.forward(mx.array([[s[-1]] for s in sequences]), batch)
        nxt = mx.argmax(model.logits(hidden)[:, -1], axis=-1).tolist()
        for s, token in zip(sequences, nxt):
            s.append(token)
    # Each row continues alone from what the batch holds for it, and as a fresh run would.
    for row, seq in enumerate(sequences):
        extracted = [cache.extract(row) for cache in batch]
        hidden, _ = model.forward(mx.array([seq[-1:]]), extracted)
        close(model.logits(hidden)[0, -1], alone(model, seq)[1])


def test_a_verify_window_rolled_back_per_row_leaves_each_row_as_if_it_had_run_alone(model):
    batch = rows_join(model, PROMPTS)
    window = [[p[-1], 40, 41, 42] for p in PROMPTS]
    model.forward(mx.array(window), batch)
    kept = [2, 1, 4]  # tokens of each row's window that stay (pending + accepted drafts)
    for cache in batch:
        cache.trim([4 - k for k in kept])
    sequences = [p + w[1:k] for p, w, k in zip(PROMPTS, window, kept)]
    nxt = [50, 51, 52]
    hidden, _ = model.forward(mx.array([[t] for t in nxt]), batch)
    logits = model.logits(hidden)[:, -1]
    for row, seq in enumerate(sequences):
        close(logits[row], alone(model, seq + [nxt[row]])[1])


def test_a_row_that_leaves_takes_nothing_from_the_others_and_extracts_whole(model):
    batch = rows_join(model, PROMPTS)
    extracted = [cache.extract(0) for cache in batch]  # past gemma's window
    for cache in batch:
        cache.filter([1, 2])
    hidden, _ = model.forward(mx.array([[PROMPTS[1][-1]], [PROMPTS[2][-1]]]), batch)
    logits = model.logits(hidden)[:, -1]
    close(logits[0], alone(model, PROMPTS[1])[1])
    close(logits[1], alone(model, PROMPTS[2])[1])
    # The extracted row continues as a single-request cache.
    hidden, _ = model.forward(mx.array([PROMPTS[0][-1:]]), extracted)
    close(model.logits(hidden)[0, -1], alone(model, PROMPTS[0])[1])


def test_a_row_joining_a_running_batch_starts_where_its_own_cache_left_off(model):
    batch = rows_join(model, PROMPTS[:1])
    seq = list(PROMPTS[0])
    for _ in range(3):
        hidden, _ = model.forward(mx.array([[seq[-1]]]), batch)
        seq.append(int(mx.argmax(model.logits(hidden)[0, -1]).item()))
    late = PROMPTS[2]
    joined = prefilled(model, late[:-1])
    for layer, cache in enumerate(batch):
        cache.append([joined[layer]])
    hidden, _ = model.forward(mx.array([[seq[-1]], [late[-1]]]), batch)
    logits = model.logits(hidden)[:, -1]
    close(logits[0], alone(model, seq)[1])
    close(logits[1], alone(model, late)[1])


def test_trimming_more_than_a_row_holds_is_refused():
    cache = BatchKVCache()
    cache.append([None, None])
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim([1, 0])


def test_rows_that_joined_empty_keep_their_place_when_a_filled_row_joins(model):
    batch = batch_caches(model)
    for cache in batch:
        cache.append([None])  # a 1-token prompt: nothing prefilled
    filled = prefilled(model, PROMPTS[1][:-1])
    for layer, cache in enumerate(batch):
        cache.append([filled[layer]])
    hidden, _ = model.forward(mx.array([[9], [PROMPTS[1][-1]]]), batch)
    logits = model.logits(hidden)[:, -1]
    close(logits[0], alone(model, [9])[1])
    close(logits[1], alone(model, PROMPTS[1])[1])


@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("running", [0, 1, 2])
def test_a_batch_merged_in_holds_what_its_rows_appended_one_by_one_hold(bits, running):
    """merge() adds another batch's rows (a shared prefill's, padding trimmed, slots past
    each row's length stale) as appending their extracted rows does, to a batch with rows,
    with only empty rows, or with none: every row's tokens, lengths and starts alike."""
    def batch(rows: list[int]) -> BatchKVCache:
        rng = np.random.default_rng(len(rows))  # a batch built twice holds the same keys

        def keys(n: int) -> mx.array:
            return mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32))

        cache = BatchKVCache(bits=bits)
        cache.append([None] * len(rows))
        width = max(rows, default=0)
        if width:  # one update of the widest row's length, then each row trimmed to its own
            cache.update_and_fetch(mx.concatenate([keys(width) for _ in rows]),
                                   mx.concatenate([keys(width) for _ in rows]))
            cache.trim([width - n for n in rows])
        return cache

    base = [9, 3][:running] if running != 1 else [0]
    shared = batch([7, 300, 2])  # 300: past the 256-slot step, wider than the running batch
    merged, appended = batch(base), batch(base)
    appended.append([shared.extract(b) for b in range(shared.rows)])
    merged.merge(shared)
    assert (merged.lengths, merged.starts) == (appended.lengths, appended.starts)
    for b in range(merged.rows):
        mine, theirs = merged.extract(b), appended.extract(b)
        assert mine.offset == theirs.offset
        for x, y in zip(mine.state, theirs.state):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def test_merging_batches_of_different_kv_bits_is_refused():
    with pytest.raises(ValueError, match="KV bits"):
        BatchKVCache().merge(BatchKVCache(bits=8))
