"""Retrain the MTP head alone against a shipped target: ``python -m foretell_demo_train remtp``.

The shipped head was trained one step deep, on the data, against the target before it was
quantized. The engine chains it (step j reads step j - 1's output where the target's state
would be), and what it is worth is how much of the target *as shipped* it predicts. So this
trains it the way it is used: distilled from the shipped target (dequantized, as the engine
runs it) through the whole chain (:func:`~foretell_demo_train.mtp.chain_loss`), on windows as
long as the prompts it drafts after. It starts from the shipped head (``--from-scratch``:
from the target's last layer, as the family's ``mtp`` stage does), measures both heads the
way greedy speculation uses them (:func:`chain_path_acceptance`), and writes the new one as
``<out>/demo/mtp.safetensors`` with the config it needs, plus ``remtp.json``. Which head ships
is a measurement of the engine, not of this script.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from . import quantize as Q
from .redraft import (
    dequantized_state,
    open_run,
    read_safetensors,
    recorded_command,
    shipped_target,
)

#: Files of the target's dir that travel with the new head (the head alone is not a model).
_DIR_FILES = ("config.json", "generation_config.json", "special_tokens_map.json",
              "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def shipped_head_state(target_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The target dir's ``mtp_config`` and its head's float32 state (names without the
    prefix), dequantized exactly as MLX computes them."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    mtp = config.get("mtp_config")
    if not isinstance(mtp, dict) or "file" not in mtp:
        raise ValueError(f"{target_dir}/config.json: no mtp_config naming the head's file")
    bits = (mtp.get("quantization") or {}).get("bits")
    prefix = mtp.get("prefix", "mtp.")
    tensors = read_safetensors(Path(target_dir) / mtp["file"])
    state = dequantized_state(tensors, bits)
    return mtp, {k.removeprefix(prefix): v for k, v in state.items()}


def chain_path_acceptance(target, head, windows: np.ndarray, dev, prompt_len: int, gen_len: int,
                          count: int, k: int) -> dict:
    """Greedy speculation with the chained head, exactly: along the target's own greedy
    continuation of each prompt, a round whose head reads anchor t drafts k tokens (step j
    predicts token t + j + 1) and keeps the leading run that matches. Every generated anchor
    starts a round once; returns the mean kept and the share of rounds keeping >= j."""
    import torch

    from .evaluate import greedy_generate
    from .mtp import chain_outputs
    from .train import autocast

    prompts = torch.from_numpy(windows[:count, :prompt_len]).to(dev)
    gen = greedy_generate(target, prompts, gen_len, dev)
    seq = torch.cat([prompts, gen], dim=1)
    T = seq.shape[1] - k - 1
    with torch.no_grad(), autocast(dev):
        states = target.hidden(seq)
        outs = chain_outputs(head, target, states[:, :T], seq, k)
        hits = torch.stack([target.head(out).float().argmax(-1) == seq[:, j + 1 : j + 1 + T]
                            for j, out in enumerate(outs, start=1)], dim=-1)
    # Rounds over the generated part only: the prompt's anchors are not drafted from.
    leading = torch.cumprod(hits[:, prompt_len - 2 :].float(), dim=-1)
    return {"prompts": count, "prompt_tokens": prompt_len, "generated_tokens": gen_len, "k": k,
            f"expected_accepted_of_{k}": round(float(leading.sum(-1).mean()), 3),
            "kept_at_least": [round(float(leading[..., j].mean()), 3) for j in range(k)]}


def remtp(args) -> None:
    import torch

    from . import evaluate as ev
    from .export import export_mtp, state_numpy
    from .export_stage import versions, with_state
    from .models import count_params
    from .mtp import MTP_DESCRIPTION, MTPHead, chain_loss
    from .presets import preset_from_args
    from .train import TrainConfig, WindowSampler, device, train

    preset = preset_from_args(args)
    run, target_dir = open_run(args, preset, f"remtp: depth {args.depth}, decay {args.decay}, "
                               f"{args.minutes} min, windows {args.seq_len}")
    _, prep = run.load_prepared()
    dev = device()

    target = shipped_target(target_dir).to(dev).eval().requires_grad_(False)
    mtp_config, shipped_state = shipped_head_state(target_dir)
    shipped = MTPHead(target.spec)
    shipped.load_state_dict({k: torch.from_numpy(v) for k, v in shipped_state.items()})
    shipped = shipped.to(dev).eval()
    head = MTPHead.from_target(target) if args.from_scratch else copy.deepcopy(shipped)
    head = head.to(dev)

    cfg = TrainConfig(budget_s=args.minutes * 60, lr=args.lr, batch_size=args.batch_size,
                      seq_len=args.seq_len, warmup_steps=args.warmup_steps, seed=args.seed)
    run.log(f"[remtp] head {count_params(head):,} params, batch {cfg.batch_size}x{cfg.seq_len}, "
            f"lr {cfg.lr}, from {'the target' if args.from_scratch else 'the shipped head'}")
    sampler = WindowSampler(np.asarray(run.tokens("train")), cfg.seq_len, dev, run.seed + 2)
    summary = train("remtp", head, lambda batch: chain_loss(head, target, batch, args.depth,
                                                            args.decay), sampler, cfg, log=run.log)

    bits = (mtp_config.get("quantization") or {}).get("bits")
    new_state = state_numpy(head)
    new_shipped = with_state(head, Q.roundtrip_state(new_state, bits), dev)
    heldout = np.asarray(run.tokens("heldout"))
    windows = ev.heldout_windows(heldout, preset.seq_len, preset.eval_windows)
    quality: dict = {}
    for name, module in (("shipped", shipped), ("retrained", new_shipped)):
        m = {"teacher_forced": ev.mtp_metrics(target, module, windows, dev, preset.eval_batch, 0.8),
             **ev.mtp_eval(module, target, windows, dev, preset.eval_batch)}
        for prompt_len in args.eval_prompt_tokens:
            long = ev.heldout_windows(heldout, prompt_len + args.depth, preset.gen_prompts)
            m[f"greedy_path_prompt_{prompt_len}"] = chain_path_acceptance(
                target, module, long, dev, prompt_len, preset.gen_len, preset.gen_prompts,
                args.depth)
        quality[name] = m
        run.log(f"[remtp] {name} head: {json.dumps(m)}")

    out = run.out / "demo"
    out.mkdir(parents=True, exist_ok=True)
    for name in _DIR_FILES:
        if (target_dir / name).exists():
            (out / name).write_bytes((target_dir / name).read_bytes())
    config = json.loads((target_dir / "config.json").read_text())
    config["mtp_config"] = {**MTP_DESCRIPTION, **{k: v for k, v in mtp_config.items()
                                                  if k == "quantization"},
                            "hidden_for_next_step": f"output of mtp.norm (trained chained "
                                                    f"{args.depth} steps deep)"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = export_mtp(out, {f"mtp.{k}": v for k, v in new_state.items()}, bits)
    record = {"command": recorded_command(args.argv), "seed": args.seed, "versions": versions(),
              "teacher": {"dir": str(target_dir), "note": "the shipped target, dequantized"},
              "depth": args.depth, "decay": args.decay, "from_scratch": args.from_scratch,
              "bits": bits, "weights_bytes": size, "train_config": cfg.to_dict(),
              "train": summary, "corpus": prep["corpus"], "tokens": prep["tokens"],
              "quality": quality}
    (run.out / "remtp.json").write_text(json.dumps(record, indent=2) + "\n")
    if args.pack_dir:
        from .pack import pack

        pack(run.out, Path(args.pack_dir), log=run.log, names=["demo", "remtp.json"])
    run.log("finished")
