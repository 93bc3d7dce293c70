"""Drafts trained alone against a shipped target (``redraft``): the target is read back as
MLX computes with it, and the candidates are model dirs the engine pairs with that target."""

import json

import numpy as np
import pytest

from foretell_demo_train import quantize as Q
from foretell_demo_train.redraft import parse_shape, read_model_dir, recorded_command

SHAPES = {"l1": "l1:layers=1,hidden=64,heads=2,kv_heads=1,head_dim=32,ffn=128",
          "l2": "l2:layers=2,hidden=64,heads=2,kv_heads=1,head_dim=32,ffn=64",
          "g2": "g2:arch=gemma3_text,window=16,layers=2,hidden=64,heads=2,kv_heads=1,"
                "head_dim=32,ffn=64"}


def _model_spec():
    """``ModelSpec`` lives beside the trainer's torch models: tests that build one skip where
    PyTorch is not installed (it is not in foretell's ``[test]`` extra); the rest still run."""
    pytest.importorskip("torch", reason="the demo trainer needs PyTorch, which the [test] extra leaves out")
    from foretell_demo_train.models import ModelSpec

    return ModelSpec


class _Tok:
    """What export_quantized needs of a tokenizer, for a dir without one that matters."""

    def __init__(self):
        from tokenizers import Tokenizer, models

        self.tok = Tokenizer(models.BPE())

    def save(self, path):
        self.tok.save(path)

    def token_to_id(self, _):
        return 0


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_dir_reads_back_as_the_weights_mlx_dequantizes(tmp_path, bits):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("tokenizers")
    ModelSpec = _model_spec()
    from foretell_demo_train.export import export_quantized

    spec = ModelSpec(arch="qwen3", vocab_size=256, hidden_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=32, intermediate_size=128)
    rng = np.random.default_rng(bits)
    state = {"model.embed_tokens.weight": rng.standard_normal((256, 64)) * 0.02,
             "model.layers.0.mlp.up_proj.weight": rng.standard_normal((128, 64)) * 0.5,
             "model.norm.weight": 1.0 + rng.standard_normal(64) * 0.1}
    state = {k: v.astype(np.float32) for k, v in state.items()}
    export_quantized(tmp_path, spec, state, bits, _Tok(), 0)
    read_spec, read = read_model_dir(tmp_path)
    assert read_spec["hidden_size"] == 64 and read_spec["num_layers"] == 1
    stored = mx.load(str(tmp_path / "model.safetensors"))
    for name in ("model.embed_tokens", "model.layers.0.mlp.up_proj"):
        oracle = mx.dequantize(stored[name + ".weight"], stored[name + ".scales"].astype(mx.float32),
                               stored[name + ".biases"].astype(mx.float32), group_size=64, bits=bits)
        np.testing.assert_allclose(read[name + ".weight"], np.array(oracle), rtol=1e-6, atol=1e-7)
    norm = np.array(stored["model.norm.weight"].astype(mx.float32))
    assert (read["model.norm.weight"] == norm).all()
    assert not np.allclose(read["model.layers.0.mlp.up_proj.weight"],
                           Q.bf16_bits_to_f32(Q.f32_to_bf16_bits(state["model.layers.0.mlp.up_proj.weight"])))


def test_a_shape_names_every_field():
    label, kwargs = parse_shape(SHAPES["l2"])
    assert label == "l2" and kwargs["num_layers"] == 2 and kwargs["intermediate_size"] == 64
    with pytest.raises(ValueError, match="missing"):
        parse_shape("x:layers=1,hidden=64")
    with pytest.raises(ValueError, match="unknown key 'depth'"):
        parse_shape("x:depth=1")


def test_a_gemma_shape_slides_every_layer_but_the_top_one_by_default():
    ModelSpec = _model_spec()
    fields = SHAPES["l2"].split(":")[1]
    label, kwargs = parse_shape("g:arch=gemma3_text,window=512," + fields)
    spec = ModelSpec(vocab_size=256, **kwargs)
    assert label == "g" and spec.arch == "gemma3_text" and spec.sliding_window == 512
    assert spec.layer_types == ["sliding_attention", "full_attention"]
    _, kwargs = parse_shape("g:arch=gemma3_text,window=512,pattern=1," + fields)
    assert ModelSpec(vocab_size=256, **kwargs).layer_types == ["full_attention"] * 2
    for bad in ("q:window=512,", "q:pattern=2,", "g:arch=gemma3_text,",
                "g:arch=gemma3_text,window=512,pattern=3,"):
        with pytest.raises(ValueError, match="window=N|pattern=3 must be"):
            parse_shape(bad + fields)


def test_the_recorded_command_leaves_out_where_files_went(tmp_path):
    argv = ["redraft", "--target-dir", "core/foretell/demo/demo", "--work", str(tmp_path / "w"),
            "--shape", SHAPES["l1"], f"--out={tmp_path / 'o'}", "--pack-dir", str(tmp_path / "p"),
            "--minutes", "2"]
    assert recorded_command(argv) == ("python -m foretell_demo_train redraft --target-dir "
                                      f"core/foretell/demo/demo --shape {SHAPES['l1']} --minutes 2")


@pytest.fixture(scope="module")
def redrafted(produced, stdlib, tmp_path_factory):
    from foretell_demo_train.cli import main

    root = tmp_path_factory.mktemp("redraft")
    main(["redraft", "--preset", "tiny", "--target-dir", str(produced / "out" / "demo"),
          "--shape", SHAPES["l1"], "--shape", SHAPES["g2"], "--minutes", "0.03",
          "--work", str(root / "work"), "--out", str(root / "out"), "--roots", stdlib,
          "--pack-dir", str(root / "pack")])
    return root


@pytest.mark.slow
def test_the_teacher_is_the_shipped_target(produced, redrafted):
    """The checkpoint the drafts distil from computes what mlx-lm computes with the shipped
    (quantized) target dir: mlx-lm is the oracle, on the same held-out windows."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import torch
    from mlx_lm import load

    from foretell_demo_train.pipeline import load_lm

    class _Run:
        ckpt_dir = redrafted / "work" / "ckpt"

    teacher, _ = load_lm(_Run, "target", torch.device("cpu"))
    windows = np.load(produced / "work" / "tokens_heldout.npy")[:129].astype(np.int64)[None]
    with torch.no_grad():
        ours = teacher(torch.from_numpy(windows)).float().numpy()
    model, _ = load(str(produced / "out" / "demo"))
    model.set_dtype(mx.float32)  # the bf16 scales and norms, exactly; float32 arithmetic
    oracle = np.array(model(mx.array(windows)))
    np.testing.assert_allclose(ours, oracle, atol=2e-3)


@pytest.mark.slow
def test_mlx_lm_loads_every_candidate(redrafted):
    """The oracle must be able to run what ships: a draft only foretell could load would
    leave its numerics unchecked."""
    pytest.importorskip("mlx_lm")
    from mlx_lm import generate, load

    for label in ("l1", "g2"):
        model, tok = load(str(redrafted / "out" / f"demo-draft-{label}"))
        assert isinstance(generate(model, tok, prompt="def add(a, b):", max_tokens=24), str)


@pytest.mark.slow
def test_the_candidates_pair_with_the_target_in_the_engine(produced, redrafted):
    import foretell
    from foretell.plugin.registry import Kind

    target = produced / "out" / "demo"
    summary = json.loads((redrafted / "out" / "redraft.json").read_text())
    assert set(summary["candidates"]) == {"l1", "g2"}
    engine = foretell.load(str(target))
    config = engine.registry.get(Kind.DRAFT, "two-model").config
    for label, layers in (("l1", 1), ("g2", 2)):
        out = redrafted / "out" / f"demo-draft-{label}"
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == layers
        assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
        record = json.loads((out / "training.json").read_text())
        assert record["teacher"]["dir"] == str(target)
        assert str(redrafted) not in record["command"] and "--shape" in record["command"]
        assert "expected_accepted_of_4_temp0" in record["draft_teacher_forced"]
        engine.use_draft("two-model", config(model=str(out)), max_tokens=3)
        # Past the Gemma draft's 16-token window, so its rings wrap while it drafts.
        plain = engine.generate_text("def add(a, b):", max_tokens=40, speculate=False)
        assert engine.generate_text("def add(a, b):", max_tokens=40) == plain
    assert sorted(p.name for p in (redrafted / "pack").iterdir()) == ["foretell-demo.tar.gz.part00"]
