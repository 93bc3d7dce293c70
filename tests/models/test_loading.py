"""Loading model directories: what loads, and what each broken directory reports."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from foretell.errors import ModelLoadError, UnknownContribution
from foretell.model import load_model
from foretell.plugin import load_plugins
from foretell.tools.synthetic import make_model_dir, make_preset_dir, model_config


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("pristine") / "qwen3", "qwen3")


@pytest.fixture
def model_dir(pristine, tmp_path):
    """A private copy of a small valid qwen3 directory, free to break."""
    return shutil.copytree(pristine, tmp_path / "model")


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, edit):
    file = path / "model.safetensors"
    weights = dict(mx.load(str(file)))
    edit(weights)
    mx.save_safetensors(str(file), weights)


def test_unknown_model_type_lists_installed_architectures(model_dir, registry):
    edit_config(model_dir, model_type="llama9")
    with pytest.raises(UnknownContribution) as info:
        load_model(model_dir, registry)
    message = str(info.value)
    assert "llama9" in message
    for installed in ("qwen3", "qwen2", "gemma3_text", "gemma4_text"):
        assert installed in message
    assert "install a plugin" in message


def test_missing_weights_file_is_named(model_dir, registry):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not found"):
        load_model(model_dir, registry)


def test_shape_mismatch_names_the_tensor_and_the_file(model_dir, registry):
    def shrink(weights):
        weights["model.layers.1.mlp.up_proj.weight"] = mx.zeros((96, 64))

    edit_weights(model_dir, shrink)
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    message = str(info.value)
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert str(model_dir / "model.safetensors") in message
    assert "(96, 64)" in message and "(128, 64)" in message


def test_config_that_does_not_match_the_weights_is_reported(model_dir, registry):
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight' has shape"):
        load_model(model_dir, registry)


def test_missing_tensor_is_named(model_dir, registry):
    edit_weights(model_dir, lambda w: w.pop("model.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing tensor.*layers\.0\.self_attn\.k_norm\.weight"
    ):
        load_model(model_dir, registry)


def test_unexpected_tensor_is_named_with_its_file(model_dir, registry):
    edit_weights(model_dir, lambda w: w.update({"model.layers.0.surprise.weight": mx.zeros((2,))}))
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    assert "unexpected tensor 'model.layers.0.surprise.weight'" in str(info.value)
    assert "model.safetensors" in str(info.value)


def test_truncated_safetensors_names_the_file(model_dir, registry):
    file = model_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated or corrupt"):
        load_model(model_dir, registry)


def test_garbage_safetensors_names_the_file(model_dir, registry):
    (model_dir / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        load_model(model_dir, registry)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", "wide"), ("rms_norm_eps", None), ("tie_word_embeddings", "yes")],
)
def test_bad_config_field_names_the_file_and_field(model_dir, registry, field, value):
    edit_config(model_dir, **{field: value})
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    assert "config.json" in str(info.value) and field in str(info.value)


def test_unsupported_rope_type_names_the_field(model_dir, registry):
    edit_config(model_dir, rope_scaling={"rope_type": "warp", "factor": 2.0})
    with pytest.raises(ModelLoadError, match=r"rope_scaling\.rope_type: 'warp' is not supported"):
        load_model(model_dir, registry)


def test_config_json_that_is_not_json_is_reported(model_dir, registry):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot be read as JSON"):
        load_model(model_dir, registry)


def test_gemma4_mixture_of_experts_is_refused(tmp_path, registry):
    (tmp_path / "config.json").write_text(
        json.dumps(model_config("gemma4_text", {"enable_moe_block": True, "num_experts": 8}))
    )
    with pytest.raises(ModelLoadError, match="mixture-of-experts models are not supported yet"):
        load_model(tmp_path, registry)


def test_sharded_checkpoint_loads_like_a_single_file(pristine, tmp_path, registry):
    sharded = make_model_dir(tmp_path / "sharded", "qwen3", shard_bytes=40_000)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    tokens = mx.array([[3, 1, 4, 1, 5]])
    one, many = load_model(pristine, registry), load_model(sharded, registry)
    np.testing.assert_array_equal(np.array(one(tokens)), np.array(many(tokens)))


def test_shard_listed_in_the_index_but_missing_is_named(tmp_path, registry):
    sharded = make_model_dir(tmp_path / "sharded", "qwen3", shard_bytes=40_000)
    victim = sorted(sharded.glob("model-*-of-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(
        ModelLoadError, match=f"{victim.name}: listed in model.safetensors.index.json but missing"
    ):
        load_model(sharded, registry)


def test_quantized_checkpoint_honours_per_layer_overrides(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("FORETELL_CPU_UNPACK", "0")  # inspect the packed layers themselves
    path = make_model_dir(
        tmp_path / "q",
        "qwen3",
        quantize_bits=4,
        quantize_layers={
            "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            "model.layers.1.self_attn.o_proj": False,
        },
    )
    model = load_model(path, registry)
    down = model.layers[0].mlp.down_proj
    assert (down.bits, down.group_size) == (8, 32)
    assert model.layers[0].mlp.up_proj.bits == 4
    assert not hasattr(model.layers[1].self_attn.o_proj, "scales")


def test_preset_shapes_are_the_real_qwen3_ones():
    config = model_config("qwen3", preset="0.6b")
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        1024,
        28,
        151936,
    )
    with pytest.raises(ValueError, match="unknown preset"):
        make_preset_dir("/nonexistent", "7b")


def test_foreign_quantization_method_is_refused_by_name(model_dir, registry):
    edit_config(model_dir, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(
        ModelLoadError, match=r"config\.json: .*'awq' checkpoints are not supported"
    ):
        load_model(model_dir, registry)


def test_loading_reports_progress_in_bytes_up_to_the_total(tmp_path, registry):
    path = make_model_dir(tmp_path / "m", "qwen3")
    calls = []
    load_model(path, registry, progress=lambda done, total: calls.append((done, total)))
    dones = [d for d, _ in calls]
    assert calls and dones == sorted(dones) and calls[-1][0] == calls[-1][1]
    # the total is the checkpoint's tensor bytes: what a person watches being read
    import safetensors.numpy

    stored = safetensors.numpy.load_file(str(path / "model.safetensors"))
    assert calls[-1][1] == sum(a.nbytes for a in stored.values())


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "gemma4_text"])
def test_kv_heads_that_do_not_divide_the_heads_name_the_field(tmp_path, registry, model_type):
    path = make_model_dir(tmp_path / model_type, model_type)
    heads = json.loads((path / "config.json").read_text())["num_attention_heads"]
    edit_config(path, num_key_value_heads=heads + 1)
    with pytest.raises(ModelLoadError, match=rf"config\.json: field 'num_key_value_heads': {heads + 1} does not divide num_attention_heads={heads}"):
        load_model(path, registry)


def test_qwen2_heads_that_do_not_divide_the_width_name_the_field(tmp_path, registry):
    path = make_model_dir(tmp_path / "qwen2", "qwen2")
    width = json.loads((path / "config.json").read_text())["hidden_size"]
    edit_config(path, num_attention_heads=width + 1)
    with pytest.raises(ModelLoadError, match=r"field 'num_attention_heads': \d+ does not divide hidden_size="):
        load_model(path, registry)


def test_unindexed_shards_load_like_a_single_file_and_as_mlx_lm_loads_them(
    pristine, tmp_path, registry
):
    """mlx-lm loads every model*.safetensors it finds; so does foretell without an index."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    sharded = make_model_dir(tmp_path / "sharded", "qwen3", shard_bytes=40_000)
    (sharded / "model.safetensors.index.json").unlink()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    tokens = mx.array([[3, 1, 4, 1, 5]])
    one, many = load_model(pristine, registry), load_model(sharded, registry)
    np.testing.assert_array_equal(np.array(one(tokens)), np.array(many(tokens)))
    theirs, _ = mlx_lm_load_model(sharded)
    np.testing.assert_array_equal(np.array(many(tokens)), np.array(theirs(tokens)))


@pytest.mark.parametrize("dtype", [mx.int32, mx.int8, mx.bool_, mx.uint32, mx.complex64])
def test_a_dense_weight_of_a_non_float_dtype_names_the_file_and_tensor(
    model_dir, registry, dtype
):
    name = "model.layers.0.input_layernorm.weight"
    edit_weights(model_dir, lambda w: w.update({name: w[name].astype(dtype)}))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '{name}' has dtype"):
        load_model(model_dir, registry)


@pytest.mark.parametrize("dtype", [mx.int32, mx.float32, mx.uint8])
def test_a_packed_quantized_weight_of_the_wrong_dtype_names_the_file_and_tensor(
    tmp_path, registry, dtype
):
    path = make_model_dir(tmp_path / "q", "qwen3", quantize_bits=4)
    name = "model.layers.0.mlp.up_proj.weight"
    edit_weights(path, lambda w: w.update({name: w[name].astype(dtype)}))
    with pytest.raises(
        ModelLoadError, match=rf"model\.safetensors: tensor '{name}' has dtype .*uint32"
    ):
        load_model(path, registry)


def test_quantization_scales_of_an_integer_dtype_name_the_file_and_tensor(tmp_path, registry):
    path = make_model_dir(tmp_path / "q", "qwen3", quantize_bits=4)
    name = "model.layers.0.mlp.up_proj.scales"
    edit_weights(path, lambda w: w.update({name: w[name].astype(mx.int32)}))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '{name}' has dtype"):
        load_model(path, registry)


def test_quantized_layers_stay_packed_off_the_cpu_past_the_unpack_limit_and_when_asked(
    tmp_path, registry, monkeypatch
):
    """docs/generation.md: the CPU unpacks quantized layers to float32 unless as float32 they
    would take more than 4 GiB, or FORETELL_CPU_UNPACK=0; a GPU always keeps them packed."""
    import mlx.nn as nn

    from foretell.model import loading

    path = make_model_dir(tmp_path / "q", "qwen3", quantize_bits=4)
    model = load_model(path, registry)
    monkeypatch.setenv("FORETELL_CPU_UNPACK", "0")
    packed = load_model(path, registry)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in packed.named_modules())
    monkeypatch.delenv("FORETELL_CPU_UNPACK")
    if mx.default_device() == mx.cpu:
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
        assert loading.should_unpack_quantized(packed)
        monkeypatch.setattr(loading, "CPU_UNPACK_LIMIT", 1024)  # below this model's size
        assert not loading.should_unpack_quantized(packed)
        monkeypatch.undo()
    with monkeypatch.context() as device:
        device.setattr(loading.mx, "default_device", lambda: mx.Device(mx.gpu))
        assert not loading.should_unpack_quantized(packed)
