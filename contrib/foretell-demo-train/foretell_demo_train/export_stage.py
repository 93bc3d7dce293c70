"""Export stage: measure every model before/after quantization on held-out code, choose
bits per model within the size budget, write the shipped (MLX-quantized) and bf16 (HF)
model dirs, training.json per dir, quality.json and manifest.txt."""

from __future__ import annotations

import copy
import json
import platform
import shutil
import sys
import time

import numpy as np
import tokenizers
import torch

from . import evaluate as ev
from . import quantize as Q
from .export import (
    export_bf16,
    export_mtp,
    export_quantized,
    quantized_size,
    state_numpy,
    write_training_json,
)
from .models import CausalLM, ModelSpec, count_params
from .mtp import MTP_DESCRIPTION
from .pipeline import Run, load_lm, load_mtp, require_draft_ratio
from .train import device

DIRS = {"target": "demo", "draft": "demo-draft", "gemma": "demo-gemma"}
MIB = 2**20


def with_state(module, state: dict[str, np.ndarray], dev):
    clone = copy.deepcopy(module)
    clone.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return clone.to(dev).eval()


def choose_bits(measure: dict, budget: int, choices, min_gain: float, log) -> dict[str, int]:
    """All at the smallest bits, then upgrade the model whose held-out loss improves most per
    extra byte while the total stays within budget and the gain is worth it."""
    lo = min(choices)
    bits = {m: lo for m in measure}
    total = sum(measure[m]["size"][lo] for m in measure)
    if total > budget:
        raise RuntimeError(f"even {lo}-bit weights take {total / MIB:.2f} MiB > budget")
    for hi in sorted(choices)[1:]:
        gains = []
        for m, d in measure.items():
            gain = d["loss"][bits[m]] - d["loss"][hi]
            extra = d["size"][hi] - d["size"][bits[m]]
            gains.append((gain / max(extra, 1), gain, extra, m))
        for _, gain, extra, m in sorted(gains, reverse=True):
            if gain >= min_gain and total + extra <= budget:
                bits[m] = hi
                total += extra
                log(f"[bits] {m} -> {hi}-bit (loss -{gain:.4f}, +{extra / MIB:.2f} MiB)")
    return bits


def versions() -> dict:
    import numpy

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "tokenizers": tokenizers.__version__, "numpy": numpy.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def transformers_parity(path, model: CausalLM, windows: np.ndarray, dev) -> dict:
    """Load the bf16 dir with transformers and compare logits with our implementation."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {"skipped": "transformers not importable"}
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(dev).eval()
    state = Q.roundtrip_state(state_numpy(model), None)  # the bf16 weights the dir holds
    ours = with_state(model, state, dev)
    ids = torch.from_numpy(windows[:2, :-1]).to(dev)
    with torch.no_grad():
        a, b = ours(ids).float(), hf(ids).logits.float()
    return {"class": type(hf).__name__, "max_abs_logit_diff": round(float((a - b).abs().max()), 5),
            "argmax_agreement": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 5),
            "tokens": int(ids.numel())}


def stage_export(run: Run) -> None:
    p = run.preset
    dev = device()
    tok, prep = run.load_prepared()
    eos = prep["eos_id"]
    bpt = prep["heldout_bytes_per_token"]
    windows = ev.heldout_windows(np.asarray(run.tokens("heldout")), p.seq_len, p.eval_windows)
    run.log(f"[eval] {len(windows)} held-out windows of {p.seq_len} tokens")

    models, ckpts = {}, {}
    for name in DIRS:
        models[name], ckpts[name] = load_lm(run, name, dev)
    head, ckpts["mtp"] = load_mtp(run, models["target"], dev)
    params = {n: count_params(m) for n, m in models.items()} | {"mtp": count_params(head)}
    require_draft_ratio(p, params["target"], params["draft"])
    states = {n: state_numpy(m) for n, m in models.items()}
    states["mtp"] = state_numpy(head)

    # held-out loss in bf16 and at each candidate bit width
    measure: dict[str, dict] = {}
    for name in list(DIRS) + ["mtp"]:
        d = {"loss": {}, "size": {}, "metrics": {}}
        for bits in (None, *p.bits_choices):
            rs = Q.roundtrip_state(states[name], bits)
            if name == "mtp":
                m = ev.mtp_eval(with_state(head, rs, dev), models["target"], windows, dev, p.eval_batch)
                d["loss"][bits] = m["loss_t_plus_2"]
            else:
                m = ev.lm_eval(with_state(models[name], rs, dev), windows, dev, p.eval_batch, bpt)
                d["loss"][bits] = m["loss"]
            d["metrics"][bits] = m
            d["size"][bits] = quantized_size(states[name], bits)
        measure[name] = d
        run.log(f"[eval] {name}: " + ", ".join(
            f"{'bf16' if b is None else f'{b}-bit'} loss {d['loss'][b]:.4f} "
            f"({d['size'][b] / MIB:.2f} MiB)" for b in d["loss"]))
    fp_loss = {n: d["metrics"][None] for n, d in measure.items()}
    bits = choose_bits({n: {"loss": d["loss"], "size": d["size"]} for n, d in measure.items()},
                       int(p.size_budget_mib * MIB), p.bits_choices, p.min_bits_gain, run.log)

    # the shipped (quantized) models
    shipped = {n: with_state(models[n], Q.roundtrip_state(states[n], bits[n]), dev) for n in DIRS}
    shipped_head = with_state(head, Q.roundtrip_state(states["mtp"], bits["mtp"]), dev)
    k, temp = 4, 0.8
    quality: dict = {"heldout_windows": len(windows), "seq_len": p.seq_len,
                     "heldout_bytes_per_token": round(bpt, 4), "models": {}, "speculative": {}}
    for name in DIRS:
        quality["models"][name] = {
            "params": params[name], "bits": bits[name], "bf16": fp_loss[name],
            "shipped": ev.lm_eval(shipped[name], windows, dev, p.eval_batch, bpt),
            "by_bits": {str(b): measure[name]["metrics"][b] for b in p.bits_choices},
        }
    quality["models"]["mtp"] = {
        "params": params["mtp"], "bits": bits["mtp"], "bf16": fp_loss["mtp"],
        "shipped": ev.mtp_eval(shipped_head, shipped["target"], windows, dev, p.eval_batch),
        "by_bits": {str(b): measure["mtp"]["metrics"][b] for b in p.bits_choices},
    }
    t = time.time()
    for label, tg, dr, hd in (("bf16", models["target"], models["draft"], head),
                              ("shipped", shipped["target"], shipped["draft"], shipped_head)):
        quality["speculative"][label] = {
            "draft_teacher_forced": ev.draft_metrics(tg, dr, windows, dev, p.eval_batch, k, temp),
            "draft_on_target_greedy_path": ev.greedy_path_acceptance(
                tg, dr, windows, dev, p.gen_prompt_len, p.gen_len, p.gen_prompts, k),
            "mtp_teacher_forced": ev.mtp_metrics(tg, hd, windows, dev, p.eval_batch, temp),
        }
    run.log(f"[eval] speculative metrics in {time.time() - t:.1f}s: "
            + json.dumps(quality["speculative"]["shipped"]))
    held_texts = [open(path, encoding="utf-8").read() for path in _heldout_paths(run)[:200]]
    prompts = ev.completion_prompts(held_texts, 3)
    quality["completions"] = {
        "bf16": ev.completions(models["target"], tok, prompts, dev, p.completion_tokens, eos),
        "shipped": ev.completions(shipped["target"], tok, prompts, dev, p.completion_tokens, eos),
    }
    for c in quality["completions"]["shipped"]:
        run.log("[completion] " + json.dumps(c["prompt"][-80:]) + " => " + json.dumps(c["completion"]))

    _write_dirs(run, states, bits, measure, quality, ckpts, prep, params, windows, dev, tok, eos)


def _heldout_paths(run: Run) -> list[str]:
    out = []
    for line in (run.work / "manifest.txt").read_text(encoding="utf-8").splitlines()[1:]:
        split, _, path = line.split("\t", 2)
        if split == "heldout":
            out.append(path)
    return out


def _write_dirs(run, states, bits, measure, quality, ckpts, prep, params, windows, dev, tok, eos):
    p = run.preset
    run.out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    common = {
        "command": " ".join(["python -m foretell_demo_train", *sys.argv[1:]]), "seed": run.seed, "preset_notes": p.notes,
        "versions": versions(), "corpus": prep["corpus"], "tokenizer": prep["tokenizer"],
        "tokens": prep["tokens"], "heldout_bytes_per_token": prep["heldout_bytes_per_token"],
    }
    for name, dirname in DIRS.items():
        spec = ckpts[name]["spec"]
        mspec = ModelSpec(**spec)
        out = run.out / dirname
        if out.exists():
            shutil.rmtree(out)
        extra = {}
        if name == "target":
            extra = {"num_nextn_predict_layers": 1,
                     "mtp_config": {**MTP_DESCRIPTION, "quantization": {
                         "group_size": Q.GROUP_SIZE, "bits": bits["mtp"], "mode": "affine"}}}
        sizes[dirname] = {"model.safetensors": export_quantized(
            out, mspec, states[name], bits[name], tok, eos, extra)}
        if name == "target":
            sizes[dirname]["mtp.safetensors"] = export_mtp(out, {
                f"mtp.{k}": v for k, v in states["mtp"].items()}, bits["mtp"])
        bf16_dir = run.out / "hf-bf16" / dirname
        if bf16_dir.exists():
            shutil.rmtree(bf16_dir)
        export_bf16(bf16_dir, mspec, states[name], tok, eos, extra)
        if name == "target":
            export_mtp(bf16_dir, {f"mtp.{k}": v for k, v in states["mtp"].items()}, None)
        info = {
            **common, "model": name, "arch": mspec.arch, "spec": spec, "params": params[name],
            "train_config": ckpts[name]["train_config"], "train": ckpts[name]["train"],
            "heldout": quality["models"][name], "quantization_bits": bits[name],
        }
        if name == "target":
            info["mtp"] = {"params": params["mtp"], "train_config": ckpts["mtp"]["train_config"],
                           "train": ckpts["mtp"]["train"], "heldout": quality["models"]["mtp"],
                           "layout": MTP_DESCRIPTION, "quantization_bits": bits["mtp"]}
        write_training_json(out, info)
        write_training_json(bf16_dir, {**info, "quantization_bits": None})
    total = sum(sum(v.values()) for v in sizes.values())
    quality["sizes_bytes"] = sizes
    quality["weights_total_mib"] = round(total / MIB, 3)
    quality["size_budget_mib"] = p.size_budget_mib
    quality["bits"] = bits
    quality["bits_rule"] = (f"start at {min(p.bits_choices)}-bit; upgrade by held-out loss gain per "
                            f"byte if gain >= {p.min_bits_gain} and total <= budget")
    quality["transformers_parity"] = {
        d: transformers_parity(run.out / "hf-bf16" / d, load_lm(run, n, dev)[0], windows, dev)
        for n, d in DIRS.items()}
    quality["versions"] = versions()
    (run.out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    shutil.copyfile(run.work / "manifest.txt", run.out / "manifest.txt")
    run.log(f"[export] weights {total / MIB:.2f} MiB (budget {p.size_budget_mib} MiB): "
            + json.dumps(sizes))
    run.log(f"[export] transformers parity: {json.dumps(quality['transformers_parity'])}")
    if total > p.size_budget_mib * MIB:
        raise RuntimeError("shipped weights exceed the size budget")
