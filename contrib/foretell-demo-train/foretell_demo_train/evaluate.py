"""Quality measurements on held-out code: loss / perplexity / bits per byte, greedy
agreement, expected accepted drafts (greedy-match chain at temperature 0, the
speculative-sampling min(1, p/q) chain at temperature T), greedy completions."""

from __future__ import annotations

import math
import re

import numpy as np
import torch
import torch.nn.functional as F

from .models import CausalLM, lm_loss
from .mtp import MTPHead, mtp_logits
from .train import autocast


def heldout_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """``count`` non-overlapping windows of seq_len + 1 tokens spread evenly."""
    span = seq_len + 1
    available = len(tokens) // span
    if available == 0:
        raise ValueError("held-out split is shorter than one window")
    idx = np.linspace(0, available - 1, min(count, available)).astype(np.int64)
    return np.stack([tokens[i * span : (i + 1) * span] for i in idx]).astype(np.int64)


def _batches(windows: np.ndarray, dev, batch_size: int):
    for i in range(0, len(windows), batch_size):
        yield torch.from_numpy(windows[i : i + batch_size]).to(dev)


@torch.no_grad()
def lm_eval(model: CausalLM, windows: np.ndarray, dev, batch_size: int,
            bytes_per_token: float) -> dict:
    total, n = 0.0, 0
    for w in _batches(windows, dev, batch_size):
        with autocast(dev):
            logits = model(w[:, :-1])
        total += float(lm_loss(logits, w[:, 1:])) * w[:, 1:].numel()
        n += w[:, 1:].numel()
    loss = total / n
    return {"loss": round(loss, 4), "perplexity": round(math.exp(loss), 3),
            "bits_per_byte": round(loss / math.log(2) / bytes_per_token, 4)}


@torch.no_grad()
def mtp_eval(head: MTPHead, target: CausalLM, windows: np.ndarray, dev, batch_size: int) -> dict:
    total, n = 0.0, 0
    for w in _batches(windows, dev, batch_size):
        with autocast(dev):
            logits, tgt = mtp_logits(head, target, w)
        total += float(lm_loss(logits, tgt)) * tgt.numel()
        n += tgt.numel()
    loss = total / n
    return {"loss_t_plus_2": round(loss, 4), "perplexity_t_plus_2": round(math.exp(loss), 3)}


def chain_expectation(accept: torch.Tensor, k: int) -> torch.Tensor:
    """accept [B, T] per-position acceptance (0/1 or a probability) -> expected number of
    accepted drafts out of k starting at each position: sum_j prod_{i<j} accept[t+i]."""
    T = accept.shape[1] - k + 1
    prod = torch.ones_like(accept[:, :T])
    total = torch.zeros_like(prod)
    for j in range(k):
        prod = prod * accept[:, j : j + T]
        total = total + prod
    return total


def sampling_accept(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float):
    """Probability that a token sampled from q is accepted with min(1, p/q): sum min(p, q)."""
    p = F.softmax(p_logits.float() / temperature, dim=-1)
    q = F.softmax(q_logits.float() / temperature, dim=-1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def draft_metrics(target: CausalLM, draft: CausalLM, windows: np.ndarray, dev,
                  batch_size: int, k: int, temperature: float) -> dict:
    agree, acc0, acck, ntok, nchain, top1 = 0.0, 0.0, 0.0, 0, 0, 0.0
    for w in _batches(windows, dev, batch_size):
        with autocast(dev):
            tl, dl = target(w[:, :-1]).float(), draft(w[:, :-1]).float()
        match = (tl.argmax(-1) == dl.argmax(-1)).float()
        agree += float(match.sum())
        top1 += float((tl.argmax(-1) == w[:, 1:]).float().sum())
        ntok += match.numel()
        c0 = chain_expectation(match, k)
        ck = chain_expectation(sampling_accept(tl, dl, temperature), k)
        acc0 += float(c0.sum())
        acck += float(ck.sum())
        nchain += c0.numel()
    return {
        "greedy_agreement": round(agree / ntok, 4),
        "target_top1_accuracy": round(top1 / ntok, 4),
        f"expected_accepted_of_{k}_temp0": round(acc0 / nchain, 3),
        f"expected_accepted_of_{k}_temp{temperature}": round(acck / nchain, 3),
    }


@torch.no_grad()
def mtp_metrics(target: CausalLM, head: MTPHead, windows: np.ndarray, dev, batch_size: int,
                temperature: float) -> dict:
    """MTP proposal at t (for token t+2) against the target's own prediction at t+1."""
    agree, alpha, n = 0.0, 0.0, 0
    for w in _batches(windows, dev, batch_size):
        with autocast(dev):
            tl = target(w[:, :-1]).float()[:, 1:]
            ml, _ = mtp_logits(head, target, w)
        ml = ml.float()
        agree += float((tl.argmax(-1) == ml.argmax(-1)).float().sum())
        alpha += float(sampling_accept(tl, ml, temperature).sum())
        n += tl.shape[0] * tl.shape[1]
    return {
        "greedy_agreement": round(agree / n, 4),
        "expected_accepted_of_1_temp0": round(agree / n, 4),
        f"expected_accepted_of_1_temp{temperature}": round(alpha / n, 4),
    }


@torch.no_grad()
def greedy_generate(model: CausalLM, prompts: torch.Tensor, n: int, dev) -> torch.Tensor:
    """Greedy continuation by full recompute (short sequences; no KV cache needed)."""
    seq = prompts
    for _ in range(n):
        with autocast(dev):
            nxt = model(seq)[:, -1].float().argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, prompts.shape[1]:]


@torch.no_grad()
def greedy_path_acceptance(target: CausalLM, draft: CausalLM, windows: np.ndarray, dev,
                           prompt_len: int, gen_len: int, count: int, k: int) -> dict:
    """Speculative decoding at temperature 0 exactly: along the target's own greedy
    continuation, a round starting at t accepts the run of draft argmaxes that match."""
    prompts = torch.from_numpy(windows[:count, :prompt_len]).to(dev)
    gen = greedy_generate(target, prompts, gen_len, dev)
    seq = torch.cat([prompts, gen], dim=1)
    with autocast(dev):
        d = draft(seq[:, :-1]).float().argmax(-1)[:, prompt_len - 1 :]
    match = (d == gen).float()
    c = chain_expectation(match, k)
    return {"prompts": count, "prompt_tokens": prompt_len, "generated_tokens": gen_len,
            "greedy_agreement": round(float(match.mean()), 4),
            f"expected_accepted_of_{k}_temp0": round(float(c.mean()), 3)}


_DEF = re.compile(r"^\s*(async\s+)?def \w+\(.*\).*:\s*$")


def completion_prompts(texts: list[str], count: int) -> list[tuple[str, str]]:
    """(prompt, actual continuation): up to 8 lines of context ending at a def line."""
    out = []
    for text in texts:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if i >= 3 and _DEF.match(line):
                out.append(("\n".join(lines[max(0, i - 8) : i + 1]) + "\n",
                            "\n".join(lines[i + 1 : i + 9])))
                break
        if len(out) == count:
            break
    return out


@torch.no_grad()
def completions(model: CausalLM, tokenizer, prompts: list[tuple[str, str]], dev,
                max_tokens: int, eos_id: int) -> list[dict]:
    out = []
    for prompt, actual in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids], device=dev)
        gen = greedy_generate(model, ids, max_tokens, dev)[0].tolist()
        if eos_id in gen:
            gen = gen[: gen.index(eos_id)]
        out.append({"prompt": prompt, "completion": tokenizer.decode(gen),
                    "actual_continuation": actual})
    return out
