"""Does distilling the draft from the target raise greedy agreement? A CPU-sized check.

    python contrib/foretell-demo-train/experiments/distill_cpu.py TARGET_MIN DRAFT_MIN CE_WEIGHTS
    e.g. ... 4 1.5 1.0,0.25,0.0     (results quoted in docs/demo-models.md)

Trains one small target on the standard library (once; reused from ``$WORK``), then one
draft per cross-entropy weight for the same time, and prints each draft's teacher-forced
agreement with the target on held-out windows.
"""

import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from foretell_demo_train import evaluate as ev  # noqa: E402
from foretell_demo_train.pipeline import Run, load_lm, run_stages  # noqa: E402
from foretell_demo_train.presets import TINY  # noqa: E402

SEQ = 128


def preset():
    p = copy.deepcopy(TINY)
    p.vocab_candidates = [2048]
    p.tokenizer_sample_bytes = 4_000_000
    p.seq_len = SEQ
    p.max_files = 1500
    p.models["target"] = dict(arch="qwen3", hidden_size=192, num_layers=4, num_heads=3,
                              num_kv_heads=1, head_dim=64, intermediate_size=512)
    p.models["draft"] = dict(arch="qwen3", hidden_size=48, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=24, intermediate_size=128)
    for name in p.train:
        p.train[name] = dict(lr=3e-3, batch_size=16, warmup_steps=30)
    return p


def main(target_min: float, draft_min: float, ce_weights: list[float]) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    p = preset()
    work = Path(os.environ.get("WORK", "build/distill-cpu/work"))
    stdlib = str(Path(json.__file__).resolve().parent.parent)
    run = Run(preset=p, work=work, out=work.parent / "out", seed=0, compile=False,
              roots=[stdlib], t0=time.time())
    if not (work / "ckpt" / "target.pt").exists():
        run_stages(run, ["prepare", "target"], {"target": target_min})
    windows = ev.heldout_windows(np.asarray(run.tokens("heldout")), SEQ, 256)
    bytes_per_token = json.loads((work / "prepare.json").read_text())["heldout_bytes_per_token"]
    cpu = torch.device("cpu")
    target, _ = load_lm(run, "target", cpu)
    results = {}
    for w in ce_weights:
        p.distill = {"draft": {"teacher": "target", "ce_weight": w}}
        run_stages(run, ["draft"], {"draft": draft_min})
        draft, ck = load_lm(run, "draft", cpu)
        m = ev.draft_metrics(target, draft, windows, cpu, 32, 4, 0.8)
        m["heldout_loss"] = ev.lm_eval(draft, windows, cpu, 32, bytes_per_token)["loss"]
        m["steps"] = ck["train"]["steps"]
        results[w] = m
        print("RESULT", w, m, flush=True)
    return results


if __name__ == "__main__":
    out = main(float(sys.argv[1]), float(sys.argv[2]), [float(x) for x in sys.argv[3].split(",")])
    print(json.dumps(out, indent=1))
