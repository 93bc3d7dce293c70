"""foretell's own CUDA kernels compiled once with NVRTC and kept (foretell.platform.ptx), and
the guard that runs a kept kernel only after it passed a check against a reference
(otherwise the ``mx.fast.cuda_kernel`` form). NVRTC needs no GPU: where it is installed
(the H200 host; here with ``nvidia-cuda-nvrtc`` on the path) the sources are compiled for
real; the guard's fallbacks are driven with stand-ins anywhere."""

from __future__ import annotations

import ctypes
import logging

import mlx.core as mx
import numpy as np
import pytest

from foretell.platform import cuda, ptx
from foretell.store import digest


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A fresh kernel cache under ``tmp_path`` on a GPU of compute capability 9.0."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(ptx.ENV, "on")
    monkeypatch.setattr(ptx, "_PTX", {})
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    return tmp_path / "foretell" / "kernels"


def test_a_kernel_is_compiled_once_and_read_back_by_later_processes(kept, monkeypatch):
    compiled = []
    monkeypatch.setattr(ptx, "compile_ptx",
                        lambda source, name, arch: compiled.append(name) or b"\x7fELF-image")
    assert ptx.kernel_ptx("k", "extern \"C\" __global__ void k() {}") == b"\x7fELF-image"
    [path] = kept.iterdir()
    assert path.name.startswith("k-") and path.name.endswith("-sm_90.cubin")
    monkeypatch.setattr(ptx, "_PTX", {})  # as a fresh process
    assert ptx.kernel_ptx("k", "extern \"C\" __global__ void k() {}") == b"\x7fELF-image"
    assert compiled == ["k"]
    # another source is another kernel: the old image is never loaded for it
    assert ptx.kernel_ptx("k", "extern \"C\" __global__ void k() { }") == b"\x7fELF-image"
    assert compiled == ["k", "k"] and len(list(kept.iterdir())) == 2


def test_kept_kernels_are_on_on_a_cuda_gpu_unless_turned_off_and_a_bad_setting_is_named(
        kept, monkeypatch):
    from foretell.errors import ConfigError
    from foretell.platform import device

    compiled = []
    monkeypatch.setattr(ptx, "compile_ptx", lambda *a: compiled.append(a) or b"image")
    monkeypatch.delenv(ptx.ENV)
    monkeypatch.setattr(device, "on_cuda", lambda: False)
    assert ptx.kernel_ptx("k", "x") is None and compiled == []
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    assert ptx.kernel_ptx("k", "x") == b"image" and len(compiled) == 1
    monkeypatch.setenv(ptx.ENV, "off")
    assert ptx.kernel_ptx("k2", "y") is None and len(compiled) == 1
    monkeypatch.setenv(ptx.ENV, "always")
    with pytest.raises(ConfigError, match=ptx.ENV):
        ptx.kernel_ptx("k", "x")


def test_without_nvrtc_or_a_gpu_there_is_no_kept_kernel(kept, monkeypatch, caplog):
    monkeypatch.setattr(ptx, "nvrtc", lambda: None)
    with caplog.at_level(logging.INFO, logger="foretell.platform"):
        assert ptx.kernel_ptx("k", "extern \"C\" __global__ void k() {}") is None
    assert "no NVRTC" in caplog.text and not kept.exists()
    monkeypatch.setattr(cuda, "compute_capability", lambda: None)
    monkeypatch.setattr(ptx, "_PTX", {})
    assert ptx.kernel_ptx("k", "x") is None


@pytest.mark.skipif(ptx.nvrtc() is None, reason="needs NVRTC (nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("name, source", [(digest.PTX_NAME, digest.PTX_SOURCE),
                                          (cuda.PLACE_NAME, cuda.PLACE_PTX_SOURCE)])
def test_our_kernels_compile_with_nvrtc_to_machine_code(name, source):
    image = ptx.compile_ptx(source, name, (9, 0))
    assert image is not None and image[:4] == b"\x7fELF" and name.encode() in image


def test_a_bad_source_is_refused_with_nvrtcs_log(kept, caplog):
    if ptx.nvrtc() is None:
        pytest.skip("needs NVRTC (nvidia-cuda-nvrtc)")
    with caplog.at_level(logging.WARNING, logger="foretell.platform"):
        assert ptx.kernel_ptx("broken", 'extern "C" __global__ void broken() { nope; }') is None
    assert "NVRTC refused kernel broken" in caplog.text and "nope" in caplog.text


def _summing(*, inputs, **kwargs):
    """A digest kernel on the host: sums the rows (address, words) of its table."""
    return [mx.array(np.array([digest.reference(ctypes.string_at(a, n * 4))
                               for a, n in inputs[0].tolist()], dtype=np.uint64))]


def _wrong_sums(**kwargs):
    return [mx.ones((3,), dtype=mx.uint64)]


def _placing(*, inputs, **kwargs):
    """A placing kernel on the host: copies the runs (from, to, bytes) of its table."""
    for source, to, nbytes in inputs[0].tolist():
        ctypes.memmove(to, source, nbytes)
    return [mx.array([len(inputs[0])], dtype=mx.uint64)]


def _jit_form(launch):
    """An ``mx.fast.cuda_kernel`` stand-in whose kernel is ``launch``."""
    return lambda *args, **kwargs: (lambda **call: launch(**call))


def test_digests_use_the_kept_kernel_only_after_it_passes_its_check(monkeypatch, caplog):
    """A kept kernel that fails, or gives wrong sums, is never used: the
    ``mx.fast.cuda_kernel`` form is, after one warning, once it passes the same check."""
    from foretell.platform import kernels

    monkeypatch.setattr("foretell.platform.ptx.kernel_ptx", lambda name, source: b"image")
    monkeypatch.setattr(kernels, "custom_kernel", _jit_form(_summing))
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _wrong_sums)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        launch = digest._launcher()
    assert launch.__name__ == "by_jit" and "failed its check" not in caplog.text
    assert "gave" in caplog.text

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _summing)
    assert digest._launcher().__name__ == "by_ptx"


def test_a_digest_kernel_failing_its_check_in_both_forms_leaves_the_ops(monkeypatch, caplog):
    """A kernel that gives the same wrong sums for the bytes written and read would pass
    every read it checks: no form of it is used unchecked. Both failing, the MLX ops
    digest, with a warning."""
    from foretell.platform import kernels

    monkeypatch.setattr("foretell.platform.ptx.kernel_ptx", lambda name, source: b"image")
    monkeypatch.setattr(kernels, "custom_kernel", _jit_form(_wrong_sums))
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _wrong_sums)
    with pytest.raises(RuntimeError, match="gave"):
        digest._launcher()
    monkeypatch.setattr(digest, "_on_cuda", lambda: True)
    monkeypatch.setattr(digest, "_KERNEL", [])
    monkeypatch.setattr(digest, "_KERNEL_STATE", ["untried"])
    arrays = [mx.arange(40, dtype=mx.uint32), mx.arange(8, dtype=mx.uint32) * 3]
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert digest.digests(arrays) == [digest.reference(memoryview(a)) for a in arrays]
    assert digest._KERNEL_STATE[0] == "failed" and "using MLX ops" in caplog.text


def test_placing_uses_the_kept_kernel_only_after_it_passes_its_check(monkeypatch, caplog):
    from foretell.platform import kernels

    monkeypatch.setattr("foretell.platform.ptx.kernel_ptx", lambda name, source: b"image")
    monkeypatch.setattr(kernels, "custom_kernel", _jit_form(_placing))

    def refusing(**kwargs):
        raise RuntimeError("Failed to load compiled foretell_place_runs kernel")

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", refusing)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        launch = cuda._place_launcher()
    assert launch.__name__ == "by_jit" and "failed its check" in caplog.text
    monkeypatch.setattr(kernels, "custom_kernel",
                        _jit_form(lambda **call: [mx.array([0], dtype=mx.uint64)]))
    with pytest.raises(RuntimeError, match="other bytes"):
        cuda._place_launcher()  # a fallback that places nothing is not used either
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _placing)
    assert cuda._place_launcher().__name__ == "by_ptx"


def test_a_kept_kernel_that_fails_its_check_is_deleted_and_compiled_afresh_next_time(
        kept, monkeypatch, caplog):
    """A damaged kept image (one that fails as it loads) is not loaded again by later
    processes, nor retried in this one: the next process compiles the source again."""
    compiled = []
    monkeypatch.setattr(ptx, "compile_ptx",
                        lambda source, name, arch: compiled.append(name) or b"\x7fELF-image")
    source = 'extern "C" __global__ void k() {}'
    assert ptx.kernel_ptx("k", source) == b"\x7fELF-image"
    [path] = kept.iterdir()
    path.write_bytes(b"\x7fELF-trunc")  # damaged on disk
    monkeypatch.setattr(ptx, "_PTX", {})  # a fresh process

    def loading(image):
        raise RuntimeError(f"cannot load an image of {len(image)} bytes")

    with caplog.at_level(logging.WARNING, logger="foretell.platform"):
        assert ptx.checked("k", source, loading, lambda launch: None, lambda: "jit") == "jit"
    assert "failed its check" in caplog.text and not path.exists()
    assert ptx.kernel_ptx("k", source) is None  # not offered again in this process
    monkeypatch.setattr(ptx, "_PTX", {})  # the next process
    assert ptx.kernel_ptx("k", source) == b"\x7fELF-image" and compiled == ["k", "k"]
