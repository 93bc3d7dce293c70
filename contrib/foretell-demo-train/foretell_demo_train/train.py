"""Time-budgeted training: AdamW, linear warmup then cosine decay over the *time* budget
(the learning rate follows elapsed/budget), bf16 autocast on CUDA, random windows of
seq_len + 1 tokens sampled from the token array held on the device."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .models import cosine_lr


@dataclass
class TrainConfig:
    budget_s: float
    lr: float
    batch_size: int
    seq_len: int = 512
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    log_every_s: float = 10.0
    compile: bool = False
    max_steps: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(dev: torch.device):
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


class WindowSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, dev: torch.device, seed: int):
        self.data = torch.from_numpy(tokens.astype(np.int32)).to(dev)
        self.span = seq_len + 1
        if len(tokens) <= self.span:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one window")
        self.offsets = torch.arange(self.span, device=dev)
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(seed)
        self.dev = dev

    def batch(self, batch_size: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.data) - self.span, (batch_size,),
                               generator=self.gen, device=self.dev)
        return self.data[starts[:, None] + self.offsets].long()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def train(
    name: str,
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    sampler: WindowSampler,
    cfg: TrainConfig,
    log=print,
) -> dict:
    """Train ``model``'s trainable parameters with ``loss_fn(batch)`` until the time budget
    ends. Returns a summary (steps, tokens, tokens/s, final smoothed loss)."""
    dev = sampler.dev
    torch.manual_seed(cfg.seed)
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                            betas=cfg.betas, fused=fused)
    params = [p for g in opt.param_groups for p in g["params"]]
    step_fn = loss_fn
    if cfg.compile:
        step_fn = torch.compile(loss_fn)
    model.train()
    t0 = time.time()
    last_log = t0
    step = 0
    tokens = 0
    ema = None
    history = []
    while True:
        elapsed = time.time() - t0
        if elapsed >= cfg.budget_s or (cfg.max_steps and step >= cfg.max_steps):
            break
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
        lr = cfg.lr * warm * cosine_lr(elapsed / cfg.budget_s, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sampler.batch(cfg.batch_size)
        with autocast(dev):
            loss = step_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += batch.shape[0] * (batch.shape[1] - 1)
        if step % 10 == 0 or step < 10 or time.time() - last_log >= cfg.log_every_s:
            value = float(loss.detach())  # synchronizes
            ema = value if ema is None else 0.9 * ema + 0.1 * value
            now = time.time()
            if now - last_log >= cfg.log_every_s or step == 1:
                el = now - t0
                log(f"[{name}] {el:7.1f}s step {step:6d} loss {value:.4f} (ema {ema:.4f}) "
                    f"lr {lr:.2e} {tokens / el:,.0f} tok/s")
                history.append({"t": round(el, 1), "step": step, "loss": round(value, 4)})
                last_log = now
    sync(dev)
    wall = time.time() - t0
    model.eval()
    summary = {
        "steps": step,
        "tokens": tokens,
        "seconds": round(wall, 1),
        "tokens_per_s": round(tokens / max(wall, 1e-9)),
        "final_train_loss_ema": round(ema, 4) if ema is not None else None,
        "history": history,
        "device": str(dev) + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""),
    }
    log(f"[{name}] done: {step} steps, {tokens:,} tokens in {wall:.1f}s "
        f"({summary['tokens_per_s']:,} tok/s), train loss ~{summary['final_train_loss_ema']}")
    return summary
