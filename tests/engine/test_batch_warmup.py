"""On a device that compiles per shape (CUDA), warming a scheduler decodes every row count up to
its ``max_rows`` before any request, storing nothing in the cache tier and leaving the batch
policy as new; requests after it stream what they stream alone. Elsewhere it runs nothing."""

from __future__ import annotations

import foretell
from foretell import batch_warmup
from foretell.cache.codecs import load_codecs
from foretell.cache.tier import CacheTier
from foretell.scheduler import Scheduler
from foretell.tools import make_model_dir

QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


def _engine(tmp_path):
    engine = foretell.load(make_model_dir(tmp_path, "qwen3", overrides=QWEN, seed=0))
    engine.cache = CacheTier(load_codecs(engine.registry))
    return engine


def _warm(engine, monkeypatch, cuda: bool, max_rows: int = 5):
    """Warm a new scheduler with the device said to compile per shape (or not); returns it,
    what ``warm_batches`` returned and, for every plain step it ran, its row count and
    whether its rows held different lengths."""
    scheduler = Scheduler(engine, max_rows=max_rows)
    steps = []
    plain_step = Scheduler._plain_step

    def counting(self):
        steps.append((len(self._rows), len(set(self._batch[0].lengths)) > 1))
        return plain_step(self)

    monkeypatch.setattr(batch_warmup, "compiles_per_shape", lambda: cuda)
    monkeypatch.setattr(Scheduler, "_plain_step", counting)
    try:
        ran = batch_warmup.warm_batches(scheduler)
    finally:
        monkeypatch.undo()
    return scheduler, ran, steps


def test_a_compiling_device_decodes_every_row_count_and_stores_nothing(tmp_path, monkeypatch):
    engine = _engine(tmp_path)
    scheduler, ran, steps = _warm(engine, monkeypatch, cuda=True)
    assert ran == 5
    assert set(range(1, 6)) <= {rows for rows, _ in steps}  # each row count took plain steps
    # ... with rows in step and, from 2 rows, rows of different lengths (other kernels)
    assert {(rows, ragged) for rows in range(2, 6) for ragged in (False, True)} <= set(steps)
    assert engine.cache.stats()["ram"]["entries"] == 0  # the warm-up's requests: not stored
    assert not scheduler._policy._times  # what compiling steps cost is forgotten
    # A request after it streams what it streams alone, and is stored as usual.
    handle = scheduler.submit("def fib(n):", max_tokens=8, ignore_eos=True, chat=False)
    tokens = [t for e in handle if e.type == "text" for t in e.tokens]
    alone = [t for e in engine.generate("def fib(n):", max_tokens=8, ignore_eos=True,
                                        chat=False, speculate=False)
             if e.type == "text" for t in e.tokens]
    assert tokens == alone
    assert engine.cache.stats()["ram"]["entries"] == 1
    scheduler.close()


def test_elsewhere_warming_runs_nothing(tmp_path, monkeypatch):
    scheduler, ran, steps = _warm(_engine(tmp_path), monkeypatch, cuda=False)
    assert ran == 0 and steps == []
    scheduler.close()
