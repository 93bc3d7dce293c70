"""Helpers for engine tests: tiny tokenizers trained on the spot, and a tiny real model.

The model is mlx-lm's own Qwen3 module with random weights, exposed through foretell's
Model protocol, so the engine can be checked token-for-token against mlx-lm's loop on the
very same weights, independently of foretell's own loader and architectures.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

CORPUS = [
    "héllo wörld — ünïcödé 日本語のテキスト 🙂🚀 emoji",
    "the quick brown fox jumps over the lazy dog",
    "naïve café résumé 中文字符 한국어 the end",
] * 10

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def train_metaspace():
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def write_tokenizer_dir(
    path: Path,
    tok,
    config: dict,
    *,
    model_config: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if model_config is not None:
        (path / "config.json").write_text(json.dumps(model_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


class MlxLmAdapter:
    """An mlx-lm model seen through foretell's Model protocol (test-only)."""

    capabilities = frozenset()

    def __init__(self, lm):
        self.lm = lm
        self.model_type = lm.model_type
        self.vocab_size = lm.args.vocab_size

    def make_caches(self):
        # foretell's caches: the scheduler batches them (mlx-lm's model meets them through
        # _AsMlxLm, batch or not).
        from foretell.model.kvcache import KVCache

        return [KVCache() for _ in self.lm.layers]

    def forward(self, tokens, caches=None, taps=()):
        seen = [_AsMlxLm(c) for c in caches] if caches is not None else None
        return self.lm.model(tokens, seen), {}

    def logits(self, hidden):
        if self.lm.args.tie_word_embeddings:
            return self.lm.model.embed_tokens.as_linear(hidden)
        return self.lm.lm_head(hidden)

    def embed(self, tokens):
        return self.lm.model.embed_tokens(tokens)

    def sanitize(self, weights):
        return weights


class _AsMlxLm:
    """A foretell cache (single or batch) as mlx-lm's attention uses one: the offset RoPE
    takes (per row in a batch), ``update_and_fetch``, and the cache's own mask."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def offset(self):
        return self.cache.offset

    def update_and_fetch(self, keys, values):
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, n, return_array=False, window_size=None):
        return self.cache.mask(n)


def tiny_qwen3(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2):
    from mlx_lm.models import qwen3

    mx.random.seed(seed)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    lm = qwen3.Model(args)
    # Random init gives near-uniform logits; sharpen them so greedy choices are clear-cut
    # while sampling still has several likely tokens to choose from.
    lm.lm_head.weight = lm.lm_head.weight * 4
    mx.eval(lm.parameters())
    return lm
