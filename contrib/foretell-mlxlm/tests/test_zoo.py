"""Every mlx-lm architecture loads in foretell from a tiny random config and computes what
mlx-lm computes; native plugins keep the types they implement."""

from __future__ import annotations

import importlib
import sys
import types

import mlx.core as mx
import pytest

from foretell.plugin import Kind
from foretell_mlxlm import zoo
from foretell_mlxlm.adapter import Adapted

#: Modules whose every forward runs a custom Metal kernel (``mx.fast.metal_kernel``): they
#: run only where MLX has its Metal back-end (they are still registered everywhere).
NEEDS_METAL = {
    "bitnet": "its BitLinear layers multiply through a custom Metal kernel",
    "muse_spark": "its attention and experts run mlx_lm.kernels' custom Metal kernels",
}
#: Modules mlx-lm itself cannot run a prompt with, and why; a test below shows each reason
#: still holds, so a fixed mlx-lm fails it and the module joins the others.
BROKEN_IN_MLX_LM = {
    "olmo": "mlx-lm adds create_attention_mask's 'causal' (a string) to its attention "
            "scores: every prompt longer than one token raises in mlx-lm's own forward "
            "(and the module exits at import unless the ai2-olmo package is installed)",
}
#: olmo's module only checks that this package imports (and exits if not); the tests give
#: it an empty one.
OLMO_PROBE = "hf_olmo"


@pytest.fixture
def olmo_probe(monkeypatch):
    monkeypatch.setitem(sys.modules, OLMO_PROBE, types.ModuleType(OLMO_PROBE))


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
    metal = mx.metal.is_available()
    for module in zoo.modules():
        reason = BROKEN_IN_MLX_LM.get(module) or (None if metal else NEEDS_METAL.get(module))
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        yield pytest.param(module, marks=marks, id=module)


@pytest.mark.parametrize("model_type", list(_runnable()))
def test_the_architecture_loads_and_runs_as_mlx_lm_computes_it(registry, model_dir,
                                                               model_type):
    from mlx_lm.models.cache import make_prompt_cache

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
    # mlx-lm's own forward, called as foretell's were, with its own caches: some families
    # compute otherwise without caches (gemma3n's KV-shared layers) or in one call
    # (phi3small's block-sparse layers add a boolean causal mask to their scores).
    own = make_prompt_cache(model)
    lm_forward = super(Adapted, model).__call__
    whole = mx.concatenate([lm_forward(tokens[:, :4], cache=own),
                            lm_forward(tokens[:, 4:], cache=own)], axis=1)
    finite = mx.isfinite(logits)
    assert taps == {}
    assert all(c.offset == 5 for c in caches), [c.offset for c in caches]
    assert logits.shape == (1, 5, model.vocab_size)
    # -inf only where mlx-lm masks tokens itself (phi3small's reserved ids)
    assert bool(mx.all(finite | mx.isneginf(whole))) and bool(mx.all(finite.any(axis=-1)))
    assert mx.allclose(logits, whole, atol=1e-3, rtol=1e-3), float(
        mx.abs(mx.where(finite, logits - whole, 0.0)).max())


def test_every_excluded_module_is_one_of_mlx_lms():
    assert set(NEEDS_METAL) | set(BROKEN_IN_MLX_LM) <= set(zoo.modules())
    assert not set(NEEDS_METAL) & set(BROKEN_IN_MLX_LM)


@pytest.mark.parametrize("model_type", sorted(NEEDS_METAL))
def test_a_module_excluded_for_metal_fails_for_want_of_it(registry, model_dir, model_type):
    from foretell.model.loading import load_model

    if mx.metal.is_available():
        pytest.skip("Metal is here: the module runs with the others")
    model = load_model(model_dir(model_type), registry)
    with pytest.raises(RuntimeError, match="No Metal back-end"):
        mx.eval(model.forward(mx.array([[1, 5, 9]], dtype=mx.int32), model.make_caches())[0])


def test_olmo_fails_in_mlx_lms_own_forward_of_a_prompt(registry, model_dir, olmo_probe):
    from foretell.model.loading import load_model

    model = load_model(model_dir("olmo"), registry)
    with pytest.raises(ValueError, match="inplace addition"):
        mx.eval(super(Adapted, model).__call__(mx.array([[1, 5, 9]], dtype=mx.int32)))


def test_a_module_that_exits_at_import_is_a_model_error_naming_what_it_needs(monkeypatch):
    from foretell_mlxlm.adapter import build
    from foretell_mlxlm.tiny import config_for

    monkeypatch.setitem(sys.modules, OLMO_PROBE, None)  # makes the import fail
    monkeypatch.delitem(sys.modules, "mlx_lm.models.olmo", raising=False)
    with pytest.raises(ValueError, match=r"models/olmo.py cannot load: .*pip install ai2-olmo"):
        build(config_for("olmo"))


def test_phi3small_in_mlx_lm_lets_a_token_see_later_tokens_of_its_forward(registry, model_dir):
    """Why the README warns that phi3small's output depends on how tokens are grouped."""
    from mlx_lm.models.cache import make_prompt_cache

    from foretell.model.loading import load_model

    model = load_model(model_dir("phi3small"), registry)
    lm_forward = super(Adapted, model).__call__
    tokens = mx.array([[1, 5, 9, 3, 7]], dtype=mx.int32)
    first_four = lm_forward(tokens[:, :4], cache=make_prompt_cache(model))
    in_one_call = lm_forward(tokens, cache=make_prompt_cache(model))[:, :4]
    assert not mx.allclose(first_four, in_one_call, atol=1e-3, rtol=1e-3)
