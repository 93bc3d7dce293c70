"""The stages: prepare (corpus, tokenizer, token cache) -> target, draft, mtp, gemma
(time-budgeted training, checkpoints in the work dir) -> export (evaluation, bit choice,
quantized + bf16 model dirs, quality.json) -> pack. Each stage reads what the earlier
ones left in the work dir, so a run can be split over several calls."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from . import corpus as corpus_mod
from . import tokenizer as tok_mod
from .models import CausalLM, ModelSpec, count_params, distill_loss, lm_loss
from .mtp import MTPHead, mtp_logits
from .presets import Preset
from .train import TrainConfig, WindowSampler, device, train

STAGES = ["prepare", "target", "draft", "mtp", "gemma", "export"]
LM_STAGES = ("target", "draft", "gemma")


@dataclass
class Run:
    preset: Preset
    work: Path
    out: Path
    seed: int
    compile: bool
    roots: list[str] | None
    t0: float

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)

    @property
    def ckpt_dir(self) -> Path:
        return self.work / "ckpt"

    def load_prepared(self) -> tuple[Tokenizer, dict]:
        info = json.loads((self.work / "prepare.json").read_text())
        return Tokenizer.from_file(str(self.work / "tokenizer.json")), info

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.work / f"tokens_{split}.npy", mmap_mode="r")


def stage_prepare(run: Run, tokenizer: Path | None = None) -> None:
    """Corpus, tokenizer and token cache. ``tokenizer``: encode with that tokenizer.json
    (a shipped model's, for drafts trained against it) instead of training one."""
    p = run.preset
    run.work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    corpus = corpus_mod.collect(roots=run.roots, max_files=p.max_files)
    summary = corpus.summary()
    run.log(f"[corpus] {summary['train_files']} train files ({summary['train_bytes'] / 1e6:.1f} MB), "
            f"{summary['heldout_files']} held-out ({summary['heldout_bytes'] / 1e6:.1f} MB), "
            f"skipped {summary['skipped']} in {time.time() - t:.1f}s")
    corpus.write_manifest(run.work / "manifest.txt")
    if tokenizer is None:
        tok, vocab_info = tok_mod.build(corpus.train, corpus.heldout, p.vocab_candidates,
                                        p.tokenizer_sample_bytes, p.vocab_tolerance, log=run.log)
    else:
        tok = Tokenizer.from_file(str(tokenizer))
        vocab_info = {"type": f"reused from {tokenizer}",
                      "chosen_vocab_size": tok.get_vocab_size()}
        run.log(f"[tokenizer] reused {tokenizer} ({tok.get_vocab_size()} tokens)")
    tok.save(str(run.work / "tokenizer.json"))
    counts = {}
    for split, files in (("train", corpus.train), ("heldout", corpus.heldout)):
        t = time.time()
        arr = tok_mod.encode_files(tok, files)
        np.save(run.work / f"tokens_{split}.npy", arr)
        counts[split] = int(len(arr))
        nbytes = sum(s for _, s in files)
        run.log(f"[tokens] {split}: {len(arr):,} tokens in {time.time() - t:.1f}s "
                f"({nbytes / max(time.time() - t, 1e-9) / 1e6:.1f} MB/s, {os.cpu_count()} cores)")
    info = {
        "corpus": summary,
        "tokenizer": vocab_info,
        "tokens": counts,
        "heldout_bytes_per_token": summary["heldout_bytes"] / max(counts["heldout"], 1),
        "eos_id": tok.token_to_id(tok_mod.EOS),
        "vocab_size": tok.get_vocab_size(),
    }
    (run.work / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")


def require_draft_ratio(preset: Preset, target_params: int, draft_params: int) -> None:
    """The target must be at least ``preset.min_target_draft_ratio`` times the draft."""
    ratio = target_params / draft_params
    if ratio < preset.min_target_draft_ratio:
        raise RuntimeError(f"target/draft parameter ratio {ratio:.2f} < "
                           f"{preset.min_target_draft_ratio} ({target_params:,} / {draft_params:,})")


def model_spec(run: Run, name: str, vocab_size: int) -> ModelSpec:
    return ModelSpec(vocab_size=vocab_size, max_position_embeddings=4096,
                     **run.preset.models[name])


def train_config(run: Run, name: str, minutes: float) -> TrainConfig:
    return TrainConfig(budget_s=minutes * 60, seq_len=run.preset.seq_len, seed=run.seed,
                       compile=run.compile, **run.preset.train[name])


def save_ckpt(run: Run, name: str, module: torch.nn.Module, spec: ModelSpec, cfg: TrainConfig,
              summary: dict) -> None:
    run.ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"spec": spec.to_dict(), "state": module.state_dict(),
                "train_config": cfg.to_dict(), "train": summary}, run.ckpt_dir / f"{name}.pt")


def load_lm(run: Run, name: str, dev) -> tuple[CausalLM, dict]:
    ck = torch.load(run.ckpt_dir / f"{name}.pt", map_location="cpu", weights_only=False)
    model = CausalLM(ModelSpec(**ck["spec"]))
    model.load_state_dict(ck["state"])
    return model.to(dev).eval(), ck


def load_mtp(run: Run, target: CausalLM, dev) -> tuple[MTPHead, dict]:
    ck = torch.load(run.ckpt_dir / "mtp.pt", map_location="cpu", weights_only=False)
    head = MTPHead(target.spec)
    head.load_state_dict(ck["state"])
    return head.to(dev).eval(), ck


def stage_lm(run: Run, name: str, minutes: float) -> None:
    _, info = run.load_prepared()
    dev = device()
    torch.manual_seed(run.seed)
    spec = model_spec(run, name, info["vocab_size"])
    model = CausalLM(spec).to(dev)
    if name == "draft" or name.startswith("draft-"):  # fail before training, not at export
        target = CausalLM(model_spec(run, "target", info["vocab_size"]))
        require_draft_ratio(run.preset, count_params(target), count_params(model))
    cfg = train_config(run, name, minutes)
    run.log(f"[{name}] {spec.arch}: {count_params(model):,} params, budget {minutes} min, "
            f"batch {cfg.batch_size}x{cfg.seq_len}, device {dev}")
    sampler = WindowSampler(np.asarray(run.tokens("train")), cfg.seq_len, dev, run.seed)
    distill = run.preset.distill.get(name)
    if distill and distill["ce_weight"] < 1.0:
        teacher, _ = load_lm(run, distill["teacher"], dev)
        teacher.requires_grad_(False)
        run.log(f"[{name}] distilled from the frozen {distill['teacher']} "
                f"({count_params(teacher):,} params), ce_weight {distill['ce_weight']}")

        def loss_fn(batch):
            ids = batch[:, :-1]
            with torch.no_grad():
                teacher_logits = teacher(ids)
            return distill_loss(model(ids), teacher_logits, batch[:, 1:], distill["ce_weight"])
    else:
        distill = None

        def loss_fn(batch):
            return lm_loss(model(batch[:, :-1]), batch[:, 1:])

    summary = train(name, model, loss_fn, sampler, cfg, log=run.log)
    summary["distill"] = distill
    save_ckpt(run, name, model, spec, cfg, summary)


def stage_mtp(run: Run, minutes: float) -> None:
    dev = device()
    torch.manual_seed(run.seed)
    target, _ = load_lm(run, "target", dev)
    target.requires_grad_(False)
    head = MTPHead.from_target(target).to(dev)
    cfg = train_config(run, "mtp", minutes)
    run.log(f"[mtp] head {count_params(head):,} params (target frozen), budget {minutes} min")
    sampler = WindowSampler(np.asarray(run.tokens("train")), cfg.seq_len, dev, run.seed + 1)

    def loss_fn(batch):
        logits, tgt = mtp_logits(head, target, batch)
        return lm_loss(logits, tgt)

    summary = train("mtp", head, loss_fn, sampler, cfg, log=run.log)
    save_ckpt(run, "mtp", head, target.spec, cfg, summary)


def run_stages(run: Run, stages: list[str], minutes: dict[str, float]) -> None:
    from .export_stage import stage_export

    if "torch" in sys.modules and device().type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    for stage in stages:
        t = time.time()
        run.log(f"== stage {stage} ==")
        if stage == "prepare":
            stage_prepare(run)
        elif stage in LM_STAGES:
            stage_lm(run, stage, minutes[stage])
        elif stage == "mtp":
            stage_mtp(run, minutes["mtp"])
        elif stage == "export":
            stage_export(run)
        run.log(f"== stage {stage} done in {time.time() - t:.1f}s ==")
