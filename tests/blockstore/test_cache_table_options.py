"""The ``[cache]`` table sets the chosen layout's own options (the block store's block size),
as ``[draft]`` sets a drafter's; a key neither the tier nor that layout knows is refused,
naming both sets of keys."""

from __future__ import annotations

import pytest

from foretell import config
from foretell.errors import ConfigError
from foretell.plugin.loader import load_plugins
from foretell_blockstore.layout import BlockStoreConfig


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def _load(registry, tmp_path, body: str):
    path = tmp_path / "run.toml"
    path.write_text(f"[cache]\n{body}\n")
    return config.load_run_config(registry, path)


def test_the_cache_table_sets_the_block_size_and_the_tier_uses_it(registry, tmp_path):
    import foretell
    from foretell.cache.tier import CacheTier
    from foretell.tools.synthetic import make_model_dir

    run = _load(registry, tmp_path, f'dir = "{tmp_path / "kv"}"\nblock_tokens = 256')
    assert run.cache.layout == "blocks"
    assert run.cache.layout_options == BlockStoreConfig(block_tokens=256)
    model = make_model_dir(tmp_path / "m", "qwen3", overrides={"hidden_size": 32,
                           "num_hidden_layers": 1, "intermediate_size": 64}, seed=0)
    engine = foretell.load(model, registry=registry)
    tier = CacheTier.from_section(engine, run.cache)
    try:
        assert tier.ssd.layout.config.block_tokens == 256
    finally:
        tier.close()


def test_without_layout_keys_the_layout_keeps_its_defaults(registry, tmp_path):
    assert _load(registry, tmp_path, "ram_gb = 1.0").cache.layout_options is None


def test_a_key_neither_the_tier_nor_the_layout_knows_is_refused(registry, tmp_path):
    with pytest.raises(ConfigError) as info:
        _load(registry, tmp_path, "block_size = 256")
    message = str(info.value)
    assert "cache.block_size: unknown field (known here, with layout 'blocks':" in message
    assert "block_tokens" in message and "ram_gb" in message


def test_a_layouts_keys_belong_to_that_layout(registry, tmp_path):
    with pytest.raises(ConfigError, match="cache.block_tokens: unknown field .*'single-file'"):
        _load(registry, tmp_path, 'layout = "single-file"\nblock_tokens = 256')
    run = _load(registry, tmp_path, 'layout = "single-file"\norphan_age_s = 5.0')
    assert run.cache.layout_options.orphan_age_s == 5.0


def test_a_bad_value_names_the_key(registry, tmp_path):
    with pytest.raises(ConfigError, match="cache.block_tokens"):
        _load(registry, tmp_path, "block_tokens = 0")
