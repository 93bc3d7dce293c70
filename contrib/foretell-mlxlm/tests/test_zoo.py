"""Every mlx-lm architecture loads in foretell from a tiny random config and computes what
mlx-lm computes; native plugins keep the types they implement."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

from foretell.plugin import Kind
from foretell_mlxlm import zoo
from foretell_mlxlm.adapter import Adapted

#: Modules that cannot run here, and why (each is still registered: a user's machine may run it).
CANNOT_RUN = {
    "bitnet": "its kernel is a Metal-only custom kernel (mx.fast.metal_kernel); no Metal here",
    "olmo": "mlx-lm's module exits at import unless the ai2-olmo package is installed",
    "phi3small": "its blocksparse attention crashes MLX's CPU backend (double free) on a "
                 "tiny config",
    "prism_hadamard_qwen35": "needs a Hadamard rotation pack that ships with its checkpoints",
}
#: Families whose tiny config the table in foretell_mlxlm.tiny does not describe yet.
NO_TINY_CONFIG = {
    "afm7", "apertus", "gemma3n", "glm_moe_dsa", "granitemoehybrid", "hunyuan", "kimi_k3",
    "kimi_linear", "llama4", "mimo_v2_flash", "minicpm3", "minimax_m3_vl", "muse_spark",
    "nemotron-nas", "plamo", "kimi_k25",
}


def test_the_alias_table_is_mlx_lms_own():
    from mlx_lm.utils import MODEL_REMAPPING

    assert zoo.REMAPPED == MODEL_REMAPPING


def test_every_module_listed_is_an_architecture_and_every_helper_is_not():
    for name in zoo.HELPERS:
        module = importlib.import_module(f"mlx_lm.models.{name}")
        assert not hasattr(module, "ModelArgs") or not hasattr(module, "Model"), name
    assert len(zoo.modules()) > 100


def test_every_model_type_is_registered_as_a_fallback_and_natives_keep_theirs(registry):
    for model_type in zoo.model_types():
        served = registry.get(Kind.ARCHITECTURE, model_type)
        assert served.fallback == (served.origin.plugin == "mlxlm"), model_type
    for native in ("qwen3", "qwen2", "gemma3_text", "gemma4_text"):
        assert registry.get(Kind.ARCHITECTURE, native).origin.plugin != "mlxlm"
    assert registry.get(Kind.ARCHITECTURE, "llama").origin.plugin == "mlxlm"


def _runnable():
    for module in zoo.modules():
        reason = CANNOT_RUN.get(module) or (
            "no tiny config in foretell_mlxlm.tiny yet" if module in NO_TINY_CONFIG else None)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        yield pytest.param(module, marks=marks, id=module)


@pytest.mark.parametrize("model_type", list(_runnable()))
def test_the_architecture_loads_and_runs_as_mlx_lm_computes_it(registry, model_dir,
                                                               model_type):
    from foretell.model.loading import load_model

    served = registry.get(Kind.ARCHITECTURE, model_type)
    if served.origin.plugin != "mlxlm":
        pytest.skip(f"served natively by plugin '{served.origin.plugin}'")
    model = load_model(model_dir(model_type), registry)
    tokens = mx.array([[1, 5, 9, 3, 7]], dtype=mx.int32)
    caches = model.make_caches()
    hidden, taps = model.forward(tokens[:, :4], caches)
    step, _ = model.forward(tokens[:, 4:], caches)
    logits = model.logits(mx.concatenate([hidden, step], axis=1))
    whole = super(Adapted, model).__call__(tokens)  # mlx-lm's own forward, no caches
    assert taps == {}
    assert all(c.offset == 5 for c in caches), [c.offset for c in caches]
    assert logits.shape == (1, 5, model.vocab_size)
    assert bool(mx.all(mx.isfinite(logits)))
    assert mx.allclose(logits, whole, atol=1e-3, rtol=1e-3), float(mx.abs(logits - whole).max())
