"""Byte-level BPE tokenizer: train once at the largest candidate vocabulary, derive the
smaller candidates by truncating the merge list (BPE training is greedy, so the first
merges of a large run are the merges of a smaller run), measure bytes/token on held-out
files, pick the vocabulary, save the HF tokenizer files, and encode the corpus."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import read_text

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS]


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    # ignore_merges: a word already in the vocabulary is one token (same ids, ~40% faster)
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def truncate(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """The tokenizer a BPE run with ``vocab_size`` would have produced: ids < vocab_size
    and the merges that create them."""
    spec = json.loads(tok.to_str())
    model = spec["model"]
    vocab = {t: i for t, i in model["vocab"].items() if i < vocab_size}
    base = sum(1 for i in vocab.values() if i < len(SPECIAL_TOKENS) + 256)
    merges = model["merges"][: vocab_size - base]
    for m in merges:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a + b not in vocab:
            raise ValueError(f"merge {a!r}+{b!r} produces a token outside the truncated vocab")
    model["vocab"] = vocab
    model["merges"] = merges
    return Tokenizer.from_str(json.dumps(spec))


def bytes_per_token(tok: Tokenizer, texts: list[str]) -> float:
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return n_bytes / max(n_tok, 1)


def sample_texts(files: list[tuple[str, int]], max_bytes: int) -> list[str]:
    """A deterministic spread of files (every k-th) totalling about ``max_bytes``."""
    total = sum(s for _, s in files)
    step = max(1, int(total / max_bytes)) if max_bytes else 1
    picked = files[::step]
    return [read_text(p) for p, _ in picked]


def build(
    train_files: list[tuple[str, int]],
    heldout_files: list[tuple[str, int]],
    candidates: list[int],
    sample_bytes: int,
    tolerance: float,
    log=print,
) -> tuple[Tokenizer, dict]:
    t0 = time.time()
    texts = sample_texts(train_files, sample_bytes)
    sample_size = sum(len(t.encode("utf-8")) for t in texts)
    full = train_bpe(texts, max(candidates))
    log(f"[tokenizer] trained BPE {max(candidates)} on {len(texts)} files "
        f"({sample_size / 1e6:.1f} MB) in {time.time() - t0:.1f}s")
    held = sample_texts(heldout_files, sample_bytes // 4)
    measured = {}
    toks = {}
    for v in sorted(candidates):
        toks[v] = full if v == max(candidates) else truncate(full, v)
        measured[v] = bytes_per_token(toks[v], held)
        log(f"[tokenizer] vocab {v}: {measured[v]:.3f} bytes/token on held-out")
    best = max(measured.values())
    chosen = min(v for v in candidates if measured[v] >= best * (1 - tolerance))
    info = {
        "type": "byte-level BPE (tokenizers), merges truncated per candidate",
        "sample_files": len(texts),
        "sample_bytes": sample_size,
        "heldout_measure_files": len(held),
        "bytes_per_token": {str(k): round(v, 4) for k, v in measured.items()},
        "rule": f"smallest vocab within {tolerance:.0%} of the best bytes/token",
        "chosen_vocab_size": chosen,
        "seconds": round(time.time() - t0, 1),
    }
    log(f"[tokenizer] chose vocab {chosen}")
    return toks[chosen], info


def save_hf(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    special = {
        "content": EOS, "lstrip": False, "normalized": False,
        "rstrip": False, "single_word": False, "special": True,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(eos_id): special},
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        # No chat template: a code-completion model answers messages made into comments with
        # nonsense; `foretell chat` continues a transcript on a model without one.
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )


def encode_files(tok: Tokenizer, files: list[tuple[str, int]], chunk: int = 4096) -> np.ndarray:
    """Concatenate the token ids of ``files`` with EOS after each file, as uint16."""
    eos = tok.token_to_id(EOS)
    assert tok.get_vocab_size() <= 65536
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts: list[np.ndarray] = []
    for i in range(0, len(files), chunk):
        texts = [read_text(p) for p, _ in files[i : i + chunk]]
        for enc in encode(texts, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
