"""float32 weights run input-major on the CPU under OpenBLAS (foretell.platform.blas_layout):
the same model, computed faster, chosen per engine, never where the layout was not measured."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

import foretell
from foretell.platform import blas
from foretell.platform.blas_layout import InputMajorEmbedding, InputMajorLinear, lay_out
from foretell.tools import make_model_dir

PROMPT = [5, 17, 40, 3, 22, 9, 31, 2, 11]

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's layout")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tied") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("untied") / "qwen2", "qwen2")


def kinds(engine) -> set[str]:
    return {type(m).__name__ for _, m in engine.model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding, InputMajorLinear, InputMajorEmbedding))}


def logits(engine) -> mx.array:
    hidden, _ = engine.model.forward(mx.array([PROMPT]), engine.model.make_caches())
    return engine.model.logits(hidden)


def test_float32_layers_load_input_major_and_compute_the_same_model(tied):
    mlx_layout = foretell.load(tied, cpu_transpose=False)
    input_major = foretell.load(tied, cpu_transpose=True)
    if blas.STATUS.loaded is None:
        pytest.skip("OpenBLAS is not under MLX here")
    assert kinds(mlx_layout) == {"Linear", "Embedding"}
    assert kinds(input_major) == {"InputMajorLinear", "InputMajorEmbedding"}
    ours, theirs = logits(input_major), logits(mlx_layout)
    assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5).item()
    assert input_major.generate_text(PROMPT, max_tokens=12, ignore_eos=True) == \
        mlx_layout.generate_text(PROMPT, max_tokens=12, ignore_eos=True)


def test_a_tied_head_keeps_only_the_transpose_and_looks_tokens_up_exactly():
    table = nn.Embedding(50, 8)
    head = InputMajorEmbedding(table)
    tokens = mx.array([[3, 0, 49], [7, 7, 1]])
    assert mx.array_equal(head(tokens), table(tokens)).item()
    x = mx.random.normal((2, 3, 8))
    assert mx.allclose(head.as_linear(x), table.as_linear(x), atol=1e-6).item()
    assert mx.array_equal(head.weight, table.weight).item()  # the usual layout, as a view
    assert set(head.parameters()) == {"weight_t"}  # no second copy of the table


def test_a_linear_layer_with_a_bias_computes_as_mlx_does():
    layer = nn.Linear(16, 24, bias=True)
    ours = InputMajorLinear(layer)
    x = mx.random.normal((3, 16))
    assert mx.allclose(ours(x), layer(x), atol=1e-5).item()
    assert mx.array_equal(ours.weight, layer.weight).item()
    assert ours.weight_t.shape == (16, 24)


def test_a_weight_set_back_in_mlx_s_layout_stays_input_major():
    """As mlx-lm's Gemma 3n casts a layer's weight and sets it back on every call."""
    layer = nn.Linear(6, 4)
    ours = InputMajorLinear(layer)
    ours.weight = (layer.weight * 2).astype(mx.float16)
    assert set(ours.parameters()) == {"weight_t", "bias"}
    assert ours.weight_t.shape == (6, 4) and ours.weight.dtype == mx.float16
    assert mx.array_equal(ours.weight, (layer.weight * 2).astype(mx.float16)).item()
    table = InputMajorEmbedding(nn.Embedding(10, 3))
    table.weight = mx.ones((10, 3))
    assert table.weight_t.shape == (3, 10) and mx.all(table(mx.array([4])) == 1).item()


def test_an_untied_model_keeps_its_embedding_for_lookups_and_lays_out_its_head(untied):
    engine = foretell.load(untied, cpu_transpose=True)
    if blas.STATUS.loaded is None:
        pytest.skip("OpenBLAS is not under MLX here")
    assert kinds(engine) == {"InputMajorLinear", "Embedding"}


def test_only_float32_layers_change():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model.layers[1].set_dtype(mx.bfloat16)
    assert lay_out(model, vocab_size=None) == 1
    assert [type(m).__name__ for m in model.layers] == ["InputMajorLinear", "Linear"]


def test_where_openblas_is_not_under_mlx_the_layout_stays_mlx_s(tied, monkeypatch):
    foretell.load(tied)  # preloads what this host uses
    monkeypatch.setattr(blas, "STATUS", blas.BlasStatus(loaded=None, reason="FORETELL_BLAS=reference"))
    assert kinds(foretell.load(tied, cpu_transpose=True)) == {"Linear", "Embedding"}


def test_the_environment_variable_sets_the_default_a_setting_overrides(tied, monkeypatch):
    monkeypatch.setenv("FORETELL_CPU_TRANSPOSE", "0")
    assert kinds(foretell.load(tied)) == {"Linear", "Embedding"}
    if blas.STATUS.loaded is None:
        pytest.skip("OpenBLAS is not under MLX here")
    assert "InputMajorLinear" in kinds(foretell.load(tied, cpu_transpose=True))
