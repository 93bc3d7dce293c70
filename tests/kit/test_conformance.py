"""The conformance suites pass the built-in plugins and fail plugins that do nothing."""

from __future__ import annotations

import types

import pytest

from foretell import hookimpl
from foretell.plugin.testing import check_architecture, check_cache_codec, check_draft_provider


def test_the_baseline_kv_codecs_pass_the_codec_suite():
    from foretell.cache.codecs import RotatingKVCodec, StandardKVCodec
    from foretell.model import KVCache, RotatingKVCache

    check_cache_codec(StandardKVCodec(), KVCache)
    check_cache_codec(RotatingKVCodec(), lambda: RotatingKVCache(1024))


class _NothingCodec:
    name, provider_id = "nothing", "test/nothing@1"

    def matches(self, cache):
        return True

    def snapshot(self, cache):
        return {}, {}

    def load(self, tensors, meta):
        return None

    def clone(self, cache):
        return cache

    def header_trimmable(self, meta):
        return False

    def minimum_reusable_offset(self, meta):
        return 0


def test_a_codec_that_does_nothing_fails_the_codec_suite():
    from foretell.model import KVCache

    with pytest.raises(AssertionError, match="matches\\(\\) claims an arbitrary object"):
        check_cache_codec(_NothingCodec(), KVCache)


class _CopyingCodec:
    """Stores correctly, but clones by copying every buffer."""

    def __init__(self):
        from foretell.cache.codecs import StandardKVCodec

        self.inner = StandardKVCodec()
        self.name, self.provider_id = "copying", "test/copying@1"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def clone(self, cache):
        import mlx.core as mx

        tensors, meta = self.inner.snapshot(cache)
        return self.inner.load({k: mx.array(v) + 0 for k, v in tensors.items()}, meta)


def test_a_codec_that_copies_on_clone_fails_the_codec_suite():
    from foretell.model import KVCache

    with pytest.raises(AssertionError, match="copies instead of sharing"):
        check_cache_codec(_CopyingCodec(), KVCache)


def test_the_ngram_drafter_passes_the_drafter_suite():
    import foretell_ngram

    check_draft_provider(foretell_ngram, "ngram", sampled_runs=60)


class _Silent:
    """A provider whose sources never propose anything."""

    requires = frozenset()

    def __init__(self, config=None):
        pass

    def prepare(self, target):
        pass

    def open(self, target, sampler):
        from foretell.spec import Draft

        return types.SimpleNamespace(prefill=lambda feed: None, commit=lambda n: None,
                                     close=lambda: None, draft=lambda feed, n: Draft.of([]))


@hookimpl
def foretell_register_draft_providers(register):
    register("silent", f"{__name__}:_Silent")


def test_a_drafter_that_does_nothing_fails_the_drafter_suite():
    plugin = types.SimpleNamespace(
        foretell_register_draft_providers=foretell_register_draft_providers)
    with pytest.raises(AssertionError, match="never drafted a token"):
        check_draft_provider(plugin, "silent", sampled_runs=0)


def test_the_built_in_qwen3_passes_the_architecture_suite():
    import foretell_qwen

    check_architecture(foretell_qwen, "qwen3", overrides={"hidden_size": 64,
                                                          "num_hidden_layers": 2,
                                                          "intermediate_size": 128})


@hookimpl
def foretell_register_architectures(register):
    register("hollow", f"{__name__}:_hollow", synthetic="foretell_qwen.synthetic:QWEN3")


def _hollow(config):
    from foretell_qwen.qwen3 import build

    model = build(config)
    model.model_type = "hollow"
    model.make_caches = lambda: []
    return model


def test_an_architecture_without_caches_fails_the_architecture_suite():
    plugin = types.SimpleNamespace(foretell_register_architectures=foretell_register_architectures)
    with pytest.raises(AssertionError, match="make_caches\\(\\) gave no caches"):
        check_architecture(plugin, "hollow", overrides={"model_type": "hollow"})
