"""foretell's own CUDA kernels compiled once with NVRTC and kept (foretell.platform.cuda.nvrtc),
and the guard that hands out a kept kernel only after it passed a check against a reference
(otherwise reads land piece by piece, digests are computed by MLX ops). NVRTC needs no GPU:
where it is installed (a CUDA host; here with ``nvidia-cuda-nvrtc`` on the path) the sources
are compiled for real; the guard is driven with stand-ins anywhere."""

from __future__ import annotations

import ctypes
import logging

import mlx.core as mx
import numpy as np
import pytest

from foretell.platform.cuda import areas, digests, driver, nvrtc
from foretell.store import digest


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A fresh kernel cache under ``tmp_path`` on a GPU of compute capability 9.0."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_PTX", {})
    monkeypatch.setattr(driver, "compute_capability", lambda: (9, 0))
    return tmp_path / "foretell" / "kernels"


def test_a_kernel_is_compiled_once_and_read_back_by_later_processes(kept, monkeypatch):
    compiled = []
    monkeypatch.setattr(nvrtc, "compile_ptx",
                        lambda source, name, arch: compiled.append(name) or b"\x7fELF-image")
    assert nvrtc.kernel_ptx("k", "extern \"C\" __global__ void k() {}") == b"\x7fELF-image"
    [path] = kept.iterdir()
    assert path.name.startswith("k-") and path.name.endswith("-sm_90.cubin")
    monkeypatch.setattr(nvrtc, "_PTX", {})  # as a fresh process
    assert nvrtc.kernel_ptx("k", "extern \"C\" __global__ void k() {}") == b"\x7fELF-image"
    assert compiled == ["k"]
    # another source is another kernel: the old image is never loaded for it
    assert nvrtc.kernel_ptx("k", "extern \"C\" __global__ void k() { }") == b"\x7fELF-image"
    assert compiled == ["k", "k"] and len(list(kept.iterdir())) == 2


def test_without_nvrtc_or_a_gpu_there_is_no_kept_kernel(kept, monkeypatch, caplog):
    monkeypatch.setattr(nvrtc, "nvrtc", lambda: None)
    with caplog.at_level(logging.INFO, logger="foretell.platform"):
        assert nvrtc.kernel_ptx("k", "extern \"C\" __global__ void k() {}") is None
    assert "no NVRTC" in caplog.text and not kept.exists()
    monkeypatch.setattr(driver, "compute_capability", lambda: None)
    monkeypatch.setattr(nvrtc, "_PTX", {})
    assert nvrtc.kernel_ptx("k", "x") is None


@pytest.mark.skipif(nvrtc.nvrtc() is None, reason="needs NVRTC (nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("name, source", [(digests.PTX_NAME, digests.PTX_SOURCE),
                                          (areas.PLACE_NAME, areas.PLACE_PTX_SOURCE)])
def test_our_kernels_compile_with_nvrtc_to_machine_code(name, source):
    image = nvrtc.compile_ptx(source, name, (9, 0))
    assert image is not None and image[:4] == b"\x7fELF" and name.encode() in image


def test_a_bad_source_is_refused_with_nvrtcs_log(kept, caplog):
    if nvrtc.nvrtc() is None:
        pytest.skip("needs NVRTC (nvidia-cuda-nvrtc)")
    with caplog.at_level(logging.WARNING, logger="foretell.platform"):
        assert nvrtc.kernel_ptx("broken", 'extern "C" __global__ void broken() { nope; }') is None
    assert "NVRTC refused kernel broken" in caplog.text and "nope" in caplog.text


def _summing(*, inputs, **kwargs):
    """A digest kernel on the host: sums the rows (address, words) of its table."""
    return [mx.array(np.array([digest.reference(ctypes.string_at(a, n * 4))
                               for a, n in inputs[0].tolist()], dtype=np.uint64))]


def test_digests_use_the_kept_kernel_only_after_it_passes_its_check(monkeypatch):
    """A kernel giving the same wrong sums for the bytes written and read would pass every
    read it checks: one that gives other sums than the oracle is never handed out."""
    monkeypatch.setattr(nvrtc, "kernel_ptx", lambda name, source: b"image")
    monkeypatch.setattr(nvrtc, "discard", lambda name, source: None)
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel",
                        lambda **call: [mx.ones((3,), dtype=mx.uint64)])
    with pytest.raises(RuntimeError, match="gave"):
        digests._launcher()
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _summing)
    assert digests._launcher().__name__ == "by_ptx"


def _placing(*, inputs, **kwargs):
    """A placing kernel on the host: copies the runs (from, to, bytes) of its table."""
    for source, to, nbytes in inputs[0].tolist():
        ctypes.memmove(to, source, nbytes)
    return [mx.array([len(inputs[0])], dtype=mx.uint64)]


def test_placing_uses_the_kept_kernel_only_after_it_passes_its_check(monkeypatch):
    """A kept kernel that fails as it loads, or places nothing, is never handed out: the
    caller is told (and lands reads piece by piece); one that places exactly is."""
    monkeypatch.setattr(nvrtc, "kernel_ptx", lambda name, source: b"image")
    monkeypatch.setattr(nvrtc, "discard", lambda name, source: None)

    def refusing(**kwargs):
        raise RuntimeError("Failed to load compiled foretell_place_runs kernel")

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", refusing)
    with pytest.raises(RuntimeError, match="failed its check"):
        areas._place_launcher()
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel",
                        lambda **call: [mx.array([0], dtype=mx.uint64)])
    with pytest.raises(RuntimeError, match="other bytes"):
        areas._place_launcher()  # a kernel that places nothing is not used either
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _placing)
    assert areas._place_launcher().__name__ == "by_ptx"


def test_without_a_compiled_form_there_is_no_kernel_to_hand_out(kept, monkeypatch):
    monkeypatch.setattr(nvrtc, "nvrtc", lambda: None)
    with pytest.raises(RuntimeError, match="no compiled form"):
        nvrtc.checked("k", 'extern "C" __global__ void k() {}', lambda image: "launch",
                    lambda launch: None)


def test_a_kept_kernel_that_fails_its_check_is_deleted_and_compiled_afresh_next_time(
        kept, monkeypatch):
    """A damaged kept image (one that fails as it loads) is not loaded again by later
    processes, nor retried in this one: the next process compiles the source again."""
    compiled = []
    monkeypatch.setattr(nvrtc, "compile_ptx",
                        lambda source, name, arch: compiled.append(name) or b"\x7fELF-image")
    source = 'extern "C" __global__ void k() {}'
    assert nvrtc.kernel_ptx("k", source) == b"\x7fELF-image"
    [path] = kept.iterdir()
    path.write_bytes(b"\x7fELF-trunc")  # damaged on disk
    monkeypatch.setattr(nvrtc, "_PTX", {})  # a fresh process

    def loading(image):
        raise RuntimeError(f"cannot load an image of {len(image)} bytes")

    with pytest.raises(RuntimeError, match="failed its check"):
        nvrtc.checked("k", source, loading, lambda launch: None)
    assert not path.exists()
    assert nvrtc.kernel_ptx("k", source) is None  # not offered again in this process
    monkeypatch.setattr(nvrtc, "_PTX", {})  # the next process
    assert nvrtc.kernel_ptx("k", source) == b"\x7fELF-image" and compiled == ["k", "k"]
