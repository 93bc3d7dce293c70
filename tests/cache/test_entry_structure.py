"""A stored entry is served only if its layers are what the model's caches hold: an entry
re-signed with a layer removed, or with float32 keys relabelled int32 (every checksum
still passing), is deleted and the prompt computed, in both layouts; an engine whose
caches take another form than a tier's states is refused that tier."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import mlx.core as mx
import pytest

import foretell
from foretell.cache.tier import CacheTier
from foretell.errors import ConfigError
from foretell.store import format as fmt
from foretell.store.entry import form_mismatch
from foretell.tools import make_model_dir

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("structure") / "qwen3", "qwen3")


def tokens_of(engine, cache_dir, **tier_options):
    engine.cache = CacheTier.for_engine(engine, cache_dir, layout="single-file", **tier_options)
    events = list(engine.generate(PROMPT, max_tokens=8, ignore_eos=True))
    engine.cache.close(10)
    return [t for e in events[:-1] for t in e.tokens], events[-1]


def resign(path: Path, change) -> None:
    """Rewrite a single-file entry with ``change(fields, index)`` applied to its foretell
    header and safetensors index, the header hash recomputed and the tensor bytes kept:
    what an adversary who knows the format can do."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    index = json.loads(raw[8:8 + length])
    fields = json.loads(index["__metadata__"]["foretell.header"])
    change(fields, index)
    header = json.dumps(fields, separators=(",", ":"))
    index["__metadata__"]["foretell.header"] = header
    index["__metadata__"]["foretell.header_hash"] = fmt.header_hash(header)
    body = json.dumps(index, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length:])


def without_the_last_layer(fields, index):
    layer = fields["layers"].pop(-1)
    for slot in layer["tensors"].values():
        del index[slot["name"]]


def keys_relabelled_int32(fields, index):
    slot = fields["layers"][0]["tensors"]["keys"]
    slot["dtype"] = index[slot["name"]]["dtype"] = "I32"


@pytest.mark.parametrize("forge", [without_the_last_layer, keys_relabelled_int32])
def test_an_entry_that_is_not_what_the_models_caches_hold_is_never_served(
        model_dir, tmp_path, forge, caplog):
    plain, _ = tokens_of(foretell.load(model_dir), None)
    first, _ = tokens_of(foretell.load(model_dir), tmp_path)
    assert first == plain
    forged = {}
    for path in tmp_path.glob("*/*.safetensors"):
        resign(path, forge)
        forged[path] = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="foretell.cache"):
        again, stats = tokens_of(foretell.load(model_dir), tmp_path)
    assert again == plain and stats.cached_from is None
    assert any("not what this model's caches hold" in r.getMessage() for r in caplog.records)
    assert not any(path.exists() and path.read_bytes() == raw for path, raw in forged.items())


def test_an_engine_whose_caches_take_another_form_is_refused_the_tier(model_dir, tmp_path):
    engine = foretell.load(model_dir)
    tier = CacheTier.for_engine(engine, tmp_path)
    forged = tuple((*form[:-1], (form[-1][0], "int32", form[-1][2])) for form in tier.structure)
    other = CacheTier.for_engine(engine, None, structure=forged)
    with pytest.raises(ConfigError, match="not of the engine's form: layer 0 holds"):
        engine.cache = other
    engine.cache = tier  # its own form: accepted
    tier.close(10)


def test_what_the_structure_check_says_names_the_layer_and_both_forms(model_dir):
    from foretell.cache.codecs import load_codecs, snapshot_entry
    from foretell.cache.tier import engine_structure

    engine = foretell.load(model_dir)
    model = engine_structure(engine, load_codecs(engine.registry))
    caches = engine.make_caches()
    engine.model.forward(mx.array([PROMPT]), caches)
    entry = snapshot_entry(PROMPT, caches, load_codecs(engine.registry))
    assert form_mismatch(entry.layers, model) is None
    assert form_mismatch(entry.layers[:-1], model) == (
        f"{len(model) - 1} layers, the model has {len(model)}")
    swapped = [entry.layers[0], entry.layers[0].__class__(
        codec="kv", provider="x", meta={}, tensors={"keys": entry.layers[1].tensors["keys"]})]
    assert form_mismatch([*swapped, *entry.layers[2:]], model).startswith(
        "layer 1 holds keys float32[1,")
