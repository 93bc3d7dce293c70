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


class _ForgetsRowState:
    """n-gram rows whose append drops a restored row's state (takes only the tokens past
    it), as a restore that forgot to restore would."""

    def __new__(cls, config):
        from foretell_ngram.lookup import NgramIndex, NgramProvider, NgramRows

        class Rows(NgramRows):
            def append(self, starts):
                for start in starts:
                    index = NgramIndex(*self._sizes)
                    index.extend(list(start.feed.tokens)[len(start.state_tokens):])
                    self.rows.append(index)

        provider = NgramProvider(config)
        c = config
        provider.open_rows = lambda target=None: Rows(c.max_ngram, c.min_ngram,
                                                      c.tokens_per_match)
        return provider


class _CapturesNothing:
    """An n-gram provider that names a draft identity yet captures nothing."""

    def __new__(cls, config):
        from foretell_ngram.lookup import NgramProvider

        provider = NgramProvider(config)
        opened = provider.open

        def open_(target=None, sampler=None):
            source = opened(target, sampler)
            source.capture = lambda: None
            return source

        provider.open = open_
        return provider


def _ngram_variant(name, factory):
    from foretell_ngram import NgramConfig

    @hookimpl
    def foretell_register_draft_providers(register):
        register(name, f"{__name__}:{factory}", config=NgramConfig)

    return types.SimpleNamespace(
        foretell_register_draft_providers=foretell_register_draft_providers)


def test_a_drafter_whose_rows_restore_forgets_the_state_fails_the_drafter_suite():
    with pytest.raises(AssertionError, match="a row appended with the state capture"):
        check_draft_provider(_ngram_variant("forgets-rows", "_ForgetsRowState"),
                             "forgets-rows", sampled_runs=0)


def test_a_drafter_naming_a_draft_identity_must_capture_its_state():
    with pytest.raises(AssertionError, match=r"names a draft identity .* capture\(\) "
                                             "returned None between rounds"):
        check_draft_provider(_ngram_variant("captures-nothing", "_CapturesNothing"),
                             "captures-nothing", sampled_runs=0)


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
