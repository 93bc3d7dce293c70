"""Qwen-MTP: the target's own multi-token-prediction head as its drafter (``--draft mtp``).

The head (Qwen3-Next's ``mtp.*`` layout, read from the file ``config.json``'s
``mtp_config`` names beside the weights) sees, at position t, the target's final-normed
hidden state h_t and the embedding of token t+1, and predicts token t+2:

    x = fc(concat(pre_fc_norm_embedding(embed(x[t+1])), pre_fc_norm_hidden(h[t])))
    x = layers.0(x)                 # one Qwen3 decoder layer with its own KV cache
    logits = target.logits(norm(x))  # the target's embedding and head, shared

Every position passes through the head once with the target's real hidden state, so its
cache matches training (more than ``CATCH_UP_MAX`` at once: it starts over from the last
``CATCH_UP_MAX``). For k > 1 the head chains on its own output, rolled back after each
round; the demo's head is trained through that chain (docs/demo-models.md).

``draft_vocab`` drafts from a shortlist, the ids below it (byte-level BPE numbers tokens
roughly by frequency): on a small CPU the full head cost more than the head's layer
(docs/decisions.md). The target still verifies on its whole vocabulary, and a sampled
draft's ``q`` is zero outside the shortlist, which rejection sampling handles exactly.

Its state checkpoints (the head's KV cache and newest output), labelled by the head's
weights file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from foretell.model import (
    PORT_MTP,
    KVCache,
    attention_mask,
    fixed_or_ordinary,
    make_rope,
    trim_all,
)
from foretell.spec import (
    CATCH_UP_MAX,
    PORT_HIDDEN,
    Draft,
    Drafting,
    DraftState,
    Feed,
    PairingError,
    Target,
    draft_keys,
    files_fingerprint,
    resumed_keys,
)
from foretell_qwen import MTPConfig
from foretell_qwen.qwen3 import Attention, DecoderLayer

#: Positions per head forward while absorbing a long prompt (bounds activation memory).
CHUNK = 2048


class ShortlistHead:
    """The target's output head over the ids below ``size``, as ``[B, V]`` logits (-inf
    past the shortlist), or the whole head when ``size`` is 0 or covers the vocabulary."""

    def __init__(self, target: Any, size: int):
        layer = target.model.embed_tokens if target.tied else target.lm_head
        vocab = target.vocab_size
        self.target, self.vocab = target, vocab
        self.size = size if 0 < size < vocab else 0
        self.layer = layer
        if self.size:
            # Row slices of the weights (and of quantized scales and biases): one copy, once.
            self.rows = {name: mx.array(value[: self.size]) for name, value in layer.items()
                         if name in ("weight", "scales", "biases", "bias")}
            if "weight_t" in layer:  # kept input-major on the CPU (foretell.platform.blas_layout)
                self.rows["weight_t"] = mx.contiguous(layer["weight_t"][:, : self.size])
            mx.eval(list(self.rows.values()))

    def __call__(self, hidden: mx.array) -> mx.array:
        if not self.size:
            return self.target.logits(hidden)
        rows, layer = self.rows, self.layer
        if "scales" in rows:
            logits = mx.quantized_matmul(
                hidden, rows["weight"], rows["scales"], rows.get("biases"), transpose=True,
                group_size=layer.group_size, bits=layer.bits, mode=getattr(layer, "mode", "affine"),
            )
        elif "weight_t" in rows:
            logits = hidden @ rows["weight_t"]
        else:
            logits = hidden @ rows["weight"].T
        if "bias" in rows:
            logits = logits + rows["bias"]
        rest = mx.full((*logits.shape[:-1], self.vocab - self.size), -mx.inf, logits.dtype)
        return mx.concatenate([logits, rest], axis=-1)


class MTPHead(nn.Module):
    """The ``mtp.*`` subtree: two input norms, the merging ``fc``, one layer, a final norm."""

    def __init__(self, args: Any):
        super().__init__()
        H = args.hidden_size
        rope = make_rope(
            args.head_dim,
            base=args.rope_base,
            scaling=args.rope_config,
            max_position_embeddings=args.max_position_embeddings,
        )
        attention = Attention(args, head_dim=args.head_dim, qk_norm=True, bias=False, rope=rope)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [DecoderLayer(args, attention)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: Any) -> mx.array:
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        x = self.layers[0](x, attention_mask(x.shape[1], cache), cache)
        return self.norm(x)


def head_file(target: Target) -> Path:
    """The file holding the target's MTP head; :class:`PairingError` when it has none."""
    from foretell.model import read_config

    path = Path(target.path) if target.path is not None else None
    mtp = read_config(path).get("mtp_config") if path is not None else None
    if not isinstance(mtp, dict) or "file" not in mtp:
        raise PairingError(
            f"draft provider 'mtp' cannot draft for target {target.name}: its config.json "
            "declares no MTP head (mtp_config)"
        )
    file = path / mtp["file"]
    if not file.is_file():
        raise PairingError(
            f"draft provider 'mtp' cannot draft for target {target.name}: {file} is missing"
        )
    return file


def load_head(target: Target) -> MTPHead:
    """The target's MTP head; :class:`PairingError` when the target has none."""
    from foretell.model import fit_to_device, quantize_like_checkpoint, read_config

    args = getattr(target.model, "args", None)
    if target.model.model_type != "qwen3" or args is None:
        raise PairingError(
            f"draft provider 'mtp' cannot draft for target {target.name}: its MTP head is "
            f"the Qwen3 layout, the target is '{target.model.model_type}'"
        )
    file = head_file(target)
    mtp = read_config(file.parent)["mtp_config"]
    prefix = mtp.get("prefix", "mtp.")
    weights = {k.removeprefix(prefix): v for k, v in mx.load(str(file)).items()}
    head = MTPHead(args)
    if "quantization" in mtp:
        quantize_like_checkpoint(head, {"quantization": mtp["quantization"]}, weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise PairingError(f"{file}: does not fit the target's MTP head: {exc}") from exc
    fit_to_device(head)
    head.eval()
    mx.eval(head.parameters())
    return head


def head_forward(head: MTPHead, embedded: mx.array, hidden: mx.array,
                 caches: list[Any]) -> tuple[mx.array]:
    """The head as :func:`foretell.model.fixed_or_ordinary` runs it (one cache, the head's)."""
    return (head(embedded, hidden, caches[0]),)


def paired(tokens: Sequence[int], hidden: mx.array | None) -> tuple[list[int], mx.array | None]:
    """A feed's newest positions that come with the target's state that predicted them
    (``hidden`` is aligned with the end of ``tokens``, :class:`~foretell.spec.Feed`): those
    tokens and states, or ``([], None)``."""
    held = 0 if hidden is None else hidden.shape[1]
    m = min(len(tokens), held)
    if m == 0:
        return [], None
    return list(tokens[len(tokens) - m :]), hidden if m == held else hidden[:, held - m :]


def absorb(forward: Callable[[mx.array, mx.array], mx.array], embed: Callable[[mx.array], mx.array],
           tokens: Sequence[int], hidden: mx.array | None) -> mx.array | None:
    """Run one row's head (``forward(embedded, hidden)``) over a feed's positions that carry
    the target's state, ``CHUNK`` at a time; the head's output at the newest one
    (``[1, 1, H]``, it predicts what follows the feed), or None when there was none."""
    tokens, hidden = paired(tokens, hidden)
    if not tokens:
        return None
    ids = mx.array([tokens], dtype=mx.int32)
    for lo in range(0, len(tokens), CHUNK):
        out = forward(embed(ids[:, lo : lo + CHUNK]), hidden[:, lo : lo + CHUNK])
    return out[:, -1:, :]


class MTPProvider:
    requires = frozenset({PORT_HIDDEN, PORT_MTP})
    #: Up to 6 a round unless told: the demo's head keeps agreeing deep into its chain, and 6
    #: measured faster than 4 on both a CPU and a GPU (docs/decisions.md).
    draft_tokens = 6

    def __init__(self, config: MTPConfig | None = None) -> None:
        self.config = config or MTPConfig()
        self.head: MTPHead | None = None
        self.shortlist: ShortlistHead | None = None
        self._fingerprint: str | None = None

    def prepare(self, target: Target) -> None:
        self.head = load_head(target)
        self.shortlist = ShortlistHead(target.model, self.config.draft_vocab)
        self._fingerprint = files_fingerprint([head_file(target)])

    def draft_identity(self) -> dict[str, Any]:
        return {"head": self._fingerprint, "version": 1}

    def open(self, target: Target, sampler: Any) -> MTPSource:
        return MTPSource(self.head, target.model, sampler, self.shortlist)

    def open_rows(self, target: Target) -> Any:
        """Plugin API 2: every row of a batch drafted by the head at once."""
        from foretell_qwen.mtp_rows import MTPRows

        return MTPRows(self.head, target.model, self.shortlist)


class MTPSource:
    def __init__(self, head: MTPHead, target: Any, sampler: Any,
                 shortlist: ShortlistHead | None = None):
        self.head = head
        self.target = target
        self.logits = shortlist or ShortlistHead(target, 0)
        self.sampler = sampler
        self.keys = draft_keys(sampler)
        self.caches = [KVCache()]
        #: The head's output at the sequence's newest absorbed position (predicts what
        #: follows the sequence), or None before any position was absorbed.
        self.last: mx.array | None = None
        self._chained = 0

    def _forward(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        # On CUDA the head's absorbing forwards replay over fixed shapes, as the verifier's
        # do; a chained one-position step does not: masked over a whole buffer it measured
        # slower (docs/decisions.md).
        out, = fixed_or_ordinary(self.head, "MTP head", head_forward, embedded, hidden,
                                 caches=self.caches)
        return out

    def _absorb(self, feed: Feed) -> None:
        last = absorb(self._forward, self.target.embed, feed.tokens, feed.hidden)
        if last is not None:
            self.last = last

    def prefill(self, feed: Feed) -> None:
        self._absorb(feed)
        if self.last is not None:
            mx.eval(self.last, self.caches[0].state)

    def draft(self, feed: Feed, n: int) -> Draft:
        if len(feed.tokens) > CATCH_UP_MAX:
            # Drafting was off: the head starts over from the last CATCH_UP_MAX positions
            # (a fresh cache, one forward of that fixed length) instead of absorbing every
            # position since its last draft in one forward of a length that rarely repeats;
            # the verifier keeps no older states for it (Feed).
            self.caches, self.last = [KVCache()], None
            hidden = feed.hidden[:, -CATCH_UP_MAX:] if feed.hidden is not None else None
            feed = Feed(feed.tokens, hidden, feed.position)
        self._absorb(feed)
        if self.last is None:
            return Draft.of([])
        out, drafting = self.last, Drafting(self.sampler, self.keys, feed.position)
        for i in range(n):
            token = drafting.add(self.logits(out[:, -1, :]))
            if i < n - 1:
                out = self._forward(self.target.embed(token[:, None]), out)
        self._chained = n - 1
        return drafting.draft()

    def commit(self, accepted: int) -> None:
        # Chained positions used the head's own output for h; the real states arrive next.
        trim_all(self.caches, self._chained)
        self._chained = 0

    def capture(self) -> DraftState:
        return DraftState(caches=list(self.caches),
                          tensors={"last": self.last} if self.last is not None else {},
                          keys=self.keys.state() if self.keys is not None else None)

    def restore(self, state: DraftState, tokens: list[int]) -> None:
        if len(state.caches) != 1:
            raise ValueError(f"the MTP head has one layer; the stored state has {len(state.caches)}")
        self.caches = list(state.caches)
        self.last = state.tensors.get("last")
        self.keys = resumed_keys(self.keys, state)

    def close(self) -> None:
        self.caches = []
        self.last = None
