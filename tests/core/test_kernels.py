"""MLX's run-time compiled kernels on a CUDA GPU: kept in a directory that survives reboots,
one per MLX version and GPU architecture, and the quantized matmuls compiled in parallel
worker processes (foretell.platform.cuda.kernels). The suite runs on the CPU, where MLX compiles
nothing: the workers run their real matmul there and land no files, so merging is checked
on files of its own and the workers by their exit, their markers and their directories."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from foretell.platform import device
from foretell.platform.cuda import driver, kernels


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """Precompiling on (the CPU), into a kept directory of the test's."""
    kept = tmp_path / "kept"
    monkeypatch.setenv("FORETELL_PRECOMPILE_KERNELS", "on")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(kept))
    yield kept
    kernels._abandon()


def _quantized(bits: int, outputs: int = 128, inputs: int = 128) -> nn.Module:
    return nn.QuantizedLinear.from_linear(nn.Linear(inputs, outputs, bias=False),
                                          group_size=64, bits=bits)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _quantized(4, 256, 128)
        self.b = _quantized(4, 128, 128)
        self.c = _quantized(8, 64, 128)
        self.plain = nn.Linear(8, 8)


class _Provider:
    """A draft provider holding its model as an attribute, as the built-in ones do."""

    def __init__(self):
        self.model = _Model()
        self.name = "not a module"


def test_the_kept_directory_is_per_mlx_version_and_gpu_and_the_users_choice_wins(
        monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(driver, "compute_capability", lambda: (9, 0))
    kept = kernels.keep_compiled_kernels()
    assert kept == tmp_path / "foretell" / "mlx-kernels" / f"mlx-{mx.__version__}-sm_90"
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(kept)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    assert kernels.keep_compiled_kernels() == tmp_path / "mine"  # the user's setting wins
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset (the XDG rule)
    assert kernels.cache_home() == Path.home() / ".cache" / "foretell"


def test_each_kind_of_quantized_matmul_is_found_once_with_a_layers_sizes():
    class Slotted:  # a third party's provider may have no __dict__
        __slots__ = ("depth",)

    found = {k.bits: k for k in kernels.quantized_matmuls(_Provider(), None, Slotted())}
    assert sorted(found) == [4, 8]
    assert (found[4].outputs, found[4].inputs) in {(256, 128), (128, 128)}  # one 4-bit layer's
    assert (found[8].outputs, found[8].inputs) == (64, 128)
    assert {(k.group_size, k.mode, k.dtype) for k in found.values()} == {(64, "affine", "float32")}
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(1000, 128), group_size=64,
                                                     bits=6)
    assert [(k.bits, k.outputs, k.inputs) for k in kernels.quantized_matmuls(embedding)] == [
        (6, 1000, 128)]


def test_workers_compile_every_row_tile_and_mark_each_once(forced, tmp_path):
    """Each kind starts one worker per row tile; each runs its matmul (exit 0) and is marked
    in the kept directory; nothing starts again for a marked kernel; the workers'
    directories are gone."""
    before = set(Path(tempfile.gettempdir()).glob("foretell-kernels-*"))
    assert kernels.precompile(_Provider()) == 2 * len(kernels.TILE_ROWS)
    assert kernels.precompile(_Provider()) == 0  # on their way: not started twice
    assert kernels.wait() == 2 * len(kernels.TILE_ROWS)
    marks = sorted(path.name for path in forced.iterdir() if path.name.endswith(".done"))
    assert len(marks) == 6
    assert any("-b8-" in name and name.endswith("-r64.done") for name in marks)
    if device.on_cuda():  # what the workers compiled was merged in (the CPU compiles none)
        assert any(path.suffix == ".ptx" for path in forced.iterdir())
    assert kernels.precompile(_Provider()) == 0  # marked: nothing to do
    assert set(Path(tempfile.gettempdir()).glob("foretell-kernels-*")) == before


def test_a_failed_worker_is_not_marked(forced):
    bad = kernels.QuantizedMatmul(bits=4, group_size=7, mode="affine", dtype="float32",
                                  outputs=64, inputs=128)  # MLX refuses a group of 7
    model = _Model()
    original = kernels.quantized_matmuls
    try:
        kernels.quantized_matmuls = lambda *_owners: [bad]
        assert kernels.precompile(model) == len(kernels.TILE_ROWS)
    finally:
        kernels.quantized_matmuls = original
    assert kernels.wait() == 0
    assert not forced.exists() or not any(forced.iterdir())


def test_no_python_to_start_means_no_workers_and_no_error(forced, monkeypatch):
    """An embedded interpreter may have no ``sys.executable`` to run: ``load`` goes on."""
    import sys

    before = set(Path(tempfile.gettempdir()).glob("foretell-kernels-*"))
    monkeypatch.setattr(sys, "executable", str(forced / "no-such-python"))
    assert kernels.precompile(_Provider()) == 0
    assert kernels._PENDING == [] and kernels.wait() == 0
    assert set(Path(tempfile.gettempdir()).glob("foretell-kernels-*")) == before


def test_a_kept_directory_that_cannot_be_written_costs_nothing_but_the_kernels(forced,
                                                                               monkeypatch):
    """A full or read-only disk under the kept directory: the first request is not failed
    (its engine compiles what it needs), nothing is marked."""
    kernels.precompile(_Model())

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernels, "merge", full)
    assert kernels.wait() == 0 and kernels._PENDING == []
    assert not forced.exists() or not any(forced.glob("*.done"))


def test_nothing_starts_when_off_or_off_cuda(monkeypatch, tmp_path):
    monkeypatch.delenv("FORETELL_PRECOMPILE_KERNELS", raising=False)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device, "on_cuda", lambda: False)
    assert kernels.precompile(_Model()) == 0  # off a CUDA GPU, auto is off
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    monkeypatch.setenv("FORETELL_PRECOMPILE_KERNELS", "off")
    assert kernels.precompile(_Model()) == 0
    assert not any(tmp_path.iterdir())


def test_merging_lands_whole_files_and_overwrites_nothing(tmp_path):
    own, kept = tmp_path / "own", tmp_path / "kept"
    own.mkdir()
    kept.mkdir()
    (own / "a.ptx").write_bytes(b"new a")
    (own / "b.ptx").write_bytes(b"new b")
    (kept / "b.ptx").write_bytes(b"old b")
    assert kernels.merge(own, kept) == 1
    assert (kept / "a.ptx").read_bytes() == b"new a"
    assert (kept / "b.ptx").read_bytes() == b"old b"
    assert sorted(p.name for p in kept.iterdir()) == ["a.ptx", "b.ptx"]  # no partial left
    assert kernels.merge(tmp_path / "missing", kept) == 0


def test_load_starts_the_workers_and_the_first_request_waits_for_them(forced, monkeypatch):
    """The engine's own path: ``load`` starts the target's workers, ``generate`` lands them
    before its first forward."""
    from foretell.engine import load
    from foretell.platform import cuda

    monkeypatch.setattr(device, "cuda_backend", lambda: cuda)  # the engine reaches it so
    monkeypatch.setenv("FORETELL_CPU_UNPACK", "0")  # keep the demo's matmuls quantized
    engine = load("demo")
    assert len(kernels._PENDING) == len(kernels.TILE_ROWS)
    engine.generate_text("Hi", max_tokens=1, speculate=False)
    assert kernels._PENDING == []
    assert len([p for p in forced.iterdir() if p.name.endswith(".done")]) == 3


def test_workers_nobody_waited_for_are_stopped_at_exit(forced):
    kernels.precompile(_Model())
    owns = [worker.own for worker in kernels._PENDING]
    kernels._abandon()
    assert kernels._PENDING == [] and not any(own.exists() for own in owns)
