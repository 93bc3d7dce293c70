"""Path choices are engine settings: two engines in one process may differ, a bad value is
refused naming the field, and the environment variable still sets the default."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.nn as nn
import pytest

import foretell
from foretell.config import EngineSettings
from foretell.errors import ConfigError
from foretell.model import attention
from foretell.tools import make_model_dir

PROMPT = [5, 17, 40, 3, 22, 9, 31]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("dense") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("q8") / "qwen3", "qwen3", quantize_bits=8,
                          dtype="bfloat16")


def matmul_calls(engine, monkeypatch) -> int:
    """How often ``engine``'s request attends by matmuls (instead of the fused kernel)."""
    calls = []
    real = attention.matmul_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "matmul_attention", counted)
    engine.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
    monkeypatch.setattr(attention, "matmul_attention", real)
    return len(calls)


def test_two_engines_in_one_process_take_the_attention_path_each_chose(dense, monkeypatch):
    fused = foretell.load(dense, attention="fused")
    matmuls = foretell.load(dense, attention="matmul-all")
    assert matmul_calls(matmuls, monkeypatch) > 0
    assert matmul_calls(fused, monkeypatch) == 0  # the other engine's choice did not leak
    assert matmul_calls(matmuls, monkeypatch) > 0


def packed_layers(engine) -> int:
    return sum(isinstance(m, nn.QuantizedLinear) for _, m in engine.model.named_modules())


def test_two_engines_in_one_process_differ_in_cpu_unpack(quantized):
    packed = foretell.load(quantized, cpu_unpack=False)
    unpacked = foretell.load(quantized, cpu_unpack=True)
    assert packed_layers(packed) > 0 and packed_layers(unpacked) == 0
    assert (packed.compute_dtype, unpacked.compute_dtype) == ("bfloat16", "float32")
    assert packed.generate_text(PROMPT, max_tokens=3, ignore_eos=True)  # both serve


def test_quantized_weights_unpacked_on_the_cpu_are_laid_out_input_major_too(quantized):
    from foretell.platform import blas

    engine = foretell.load(quantized, cpu_unpack=True, cpu_transpose=True)
    if blas.STATUS.loaded is None:
        pytest.skip("OpenBLAS is not under MLX here")
    assert packed_layers(engine) == 0 and engine.compute_dtype == "float32"
    assert {type(m).__name__ for _, m in engine.model.named_modules()} >= {
        "InputMajorLinear", "InputMajorEmbedding"}
    assert not any(type(m) in (nn.Linear, nn.Embedding) for _, m in engine.model.named_modules())


def test_the_environment_variable_sets_the_default_a_setting_overrides(quantized, monkeypatch):
    monkeypatch.setenv("FORETELL_CPU_UNPACK", "0")
    assert packed_layers(foretell.load(quantized)) > 0
    assert packed_layers(foretell.load(quantized, cpu_unpack=True)) == 0


ATTENTION_BY_ENV = """
import json, sys
import foretell
from foretell.model import attention

calls = []
real = attention.matmul_attention
attention.matmul_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
counts = {}
for name, options in (("default", {}), ("chosen", {"attention": "matmul-all"})):
    calls.clear()
    foretell.load(sys.argv[1], **options).generate_text([5, 17, 40], max_tokens=3)
    counts[name] = len(calls)
print(json.dumps(counts))
"""


def test_the_attention_variable_is_the_process_default_under_an_engines_choice(dense):
    # FORETELL_ATTENTION is read once per process, hence a process of its own.
    env = {**os.environ, "FORETELL_ATTENTION": "fused"}
    done = subprocess.run([sys.executable, "-c", ATTENTION_BY_ENV, str(dense)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["default"] == 0 and counts["chosen"] > 0


@pytest.mark.parametrize(("name", "value", "check", "expected"), [
    ("fixed_shapes", "on", "foretell.model.fixed:fixed_shapes_on", True),
    ("fixed_shapes", "off", "foretell.model.fixed:fixed_shapes_on", False),
    ("sliding_window", "copy", "foretell.model.kvcache:window_copies", True),
    ("sliding_window", "view", "foretell.model.kvcache:window_copies", False),
    ("quantized_products", "dequantized", "foretell.cache.quantized:products_dequantized", True),
    ("quantized_products", "quantized", "foretell.cache.quantized:products_dequantized", False),
])
def test_a_choice_decides_for_the_work_its_engine_runs(name, value, check, expected):
    import importlib

    module, function = check.split(":")
    decide = getattr(importlib.import_module(module), function)
    default = decide()
    with EngineSettings(**{name: value}).active():
        assert decide() is expected
    assert decide() is default


def test_the_spill_duty_reaches_the_tier_the_engine_opens(dense, tmp_path):
    engine = foretell.load(dense, cache=tmp_path / "cache", spill_duty=0.5)
    assert engine.cache._spill.pace.duty == 0.5


@pytest.mark.parametrize(("options", "named"), [
    ({"attention": "fast"}, "engine setting 'attention': 'fast' is not one of auto, fused, "
                            "matmul, matmul-float32, matmul-all"),
    ({"fixed_shapes": True}, "engine setting 'fixed_shapes': True is not one of auto, on, off"),
    ({"cpu_unpack": "no"}, "engine setting 'cpu_unpack': 'no' is not True, False or None"),
    ({"spill_duty": 1.5}, "engine setting 'spill_duty': 1.5 is not a number in (0, 1]"),
])
def test_a_bad_setting_is_refused_naming_the_field_before_anything_loads(options, named):
    with pytest.raises(ConfigError) as info:
        foretell.load("no-such-model", **options)  # the setting is checked first
    assert str(info.value) == named
