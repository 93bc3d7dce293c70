"""Whose states a cache holds: a model's fingerprint covers its config and its weights."""

from __future__ import annotations

import shutil

import pytest

from foretell.errors import StoreError
from foretell.store.entry import WEIGHT_SAMPLE_BYTES, StoreIdentity, weights_digest
from foretell.tools import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("m") / "model", "qwen3",
                          overrides={"hidden_size": 256, "intermediate_size": 512})


def identity(path):
    return StoreIdentity.for_model_dir(path, model_id="m", codec_providers=[])


def weights_file(path):
    return next(path.glob("*.safetensors"))


def test_the_same_weights_anywhere_have_one_fingerprint(model_dir, tmp_path):
    copy = shutil.copytree(model_dir, tmp_path / "elsewhere")
    assert weights_digest(copy) == weights_digest(model_dir)
    assert identity(copy) == identity(model_dir)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_change_in_any_tensors_sampled_bytes_is_another_model(model_dir, tmp_path, where):
    """Each tensor's first, middle and last bytes are read (a fine-tune changes them all);
    one byte changed in any of them is another model, with the config unchanged."""
    import json
    import struct

    copy = shutil.copytree(model_dir, tmp_path / "tuned")
    path = weights_file(copy)
    raw = bytearray(path.read_bytes())
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    begin, end = max((t["data_offsets"] for k, t in header.items() if k != "__metadata__"),
                     key=lambda span: span[1] - span[0])
    assert end - begin > 3 * WEIGHT_SAMPLE_BYTES  # a tensor sampled in three places
    at = {"first": begin, "middle": begin + (end - begin) // 2, "last": end - 1}[where]
    raw[8 + length + at] ^= 0x40
    path.write_bytes(bytes(raw))
    assert weights_digest(copy) != weights_digest(model_dir)
    assert identity(copy).model_fingerprint != identity(model_dir).model_fingerprint


def test_a_weights_file_that_is_not_safetensors_is_named(model_dir, tmp_path):
    copy = shutil.copytree(model_dir, tmp_path / "broken")
    weights_file(copy).write_bytes(b"\xff" * 64)
    with pytest.raises(StoreError, match=str(weights_file(copy))):
        identity(copy)


def test_a_drafters_fingerprint_reads_its_config_whole_and_its_weights_sampled(model_dir,
                                                                             tmp_path):
    """Draft identities take the same digest as a target's weights: any change to a config
    (read whole) or to a tensor's sampled bytes is another drafter; a copy is the same."""
    from foretell.spec import files_fingerprint

    def files(path):
        return [path / "config.json", weights_file(path)]

    copy = shutil.copytree(model_dir, tmp_path / "draft")
    assert files_fingerprint(files(copy)) == files_fingerprint(files(model_dir))
    config = (copy / "config.json").read_text()
    (copy / "config.json").write_text(config.replace("}", ', "unused": 1}', 1))
    assert files_fingerprint(files(copy)) != files_fingerprint(files(model_dir))
