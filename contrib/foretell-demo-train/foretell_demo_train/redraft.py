"""Train draft models alone against a shipped target: ``python -m foretell_demo_train redraft``.

The shipped draft is as deep as the target (6 layers), and on a GPU, where these small
models are bound by kernel launches, a draft's depth sets its cost: the 6-layer draft costs
more per forward than the target there (docs/benchmarks.md). This trains shallower
candidates against the target *as shipped*: its MLX-quantized weights dequantized into the
trainer's torch model (what the engine runs, so what acceptance is measured against), its
tokenizer reused (a draft must share it), the corpus collected by the same rule as
``prepare``. Each candidate is distilled (pure KL, as the shipped draft), measured on
held-out code against that target, quantized within what the weights budget leaves, and
written as a model dir ``demo-draft-<label>``; ``--pack-dir`` packs them for the return
channel. Choosing which one ships is a measurement of the engine, not of this script.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np

from . import quantize as Q

#: safetensors dtypes as the exporter writes them (bf16 travels as uint16 bit patterns).
_NUMPY = {"BF16": np.uint16, "U32": np.uint32, "F32": np.float32}
#: config.json keys -> ModelSpec fields, for the Qwen3 / Gemma 3 dirs the exporter writes.
_SPEC_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings", "layer_types": "layer_types",
    "rope_theta": "rope_theta",
}
#: ``--shape`` keys -> ModelSpec fields.
_SHAPE_KEYS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
               "kv_heads": "num_kv_heads", "head_dim": "head_dim", "ffn": "intermediate_size"}
#: Optional ``--shape`` keys: ``arch=gemma3_text`` with ``window=N`` (and ``pattern=P``, by
#: default the number of layers) gives Gemma 3's layout: every P-th layer global, the others
#: sliding over N tokens. A shallow all-global draft trained on 512-token windows attends
#: badly past that distance (a 2-layer Qwen3 draft: 68% accepted at a 256-token prompt,
#: 10-13% at 992, on the H200 and the CPU); with its lower layers sliding and only the top
#: one global, a 2-layer Gemma draft accepted 56-60% at 992-2,000 tokens (CPU). Trained on
#: windows no longer than N, the layers compute the same either way; mlx-lm's gemma3_text
#: needs at least P layers (it reads the P-th layer's cache), so every layer sliding is not
#: an option for a model mlx-lm must load.
_ARCHS = ("qwen3", "gemma3_text")
MIB = 2**20


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as numpy arrays (bf16 as uint16 bit patterns)."""
    raw = Path(path).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    body = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _NUMPY:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which the "
                             f"trainer does not read ({', '.join(_NUMPY)})")
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(raw[body + start : body + end],
                                  dtype=_NUMPY[info["dtype"]]).reshape(info["shape"])
    return out


def read_model_dir(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A model dir the exporter wrote (quantized or bf16) as ModelSpec kwargs and a float32
    state dict: quantized matrices dequantized exactly as MLX computes them."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    arch = config["model_type"]
    if arch not in ("qwen3", "gemma3_text"):
        raise ValueError(f"{path}/config.json: model_type {arch!r} is not one the trainer "
                         "builds (qwen3, gemma3_text)")
    spec = {"arch": arch, **{field: config[key] for key, field in _SPEC_KEYS.items()
                             if config.get(key) is not None}}
    bits = (config.get("quantization") or {}).get("bits")
    return spec, dequantized_state(read_safetensors(path / "model.safetensors"), bits)


def dequantized_state(tensors: dict[str, np.ndarray], bits: int | None) -> dict[str, np.ndarray]:
    """A checkpoint's tensors as a float32 state dict: quantized matrices dequantized exactly
    as MLX computes them, bf16 widened."""
    state: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and base + ".scales" in tensors:
            state[name] = Q.dequantize(value, tensors[base + ".scales"],
                                       tensors[base + ".biases"], bits)
        elif value.dtype == np.uint16:
            state[name] = Q.bf16_bits_to_f32(value).reshape(value.shape)
        else:
            state[name] = np.asarray(value, dtype=np.float32)
    return state


def shipped_target(path: Path):
    """The trainer's model of a shipped model dir, its weights as MLX computes them (see
    :func:`read_model_dir`), on the CPU."""
    import torch

    from .models import CausalLM, ModelSpec

    spec_kwargs, state = read_model_dir(path)
    model = CausalLM(ModelSpec(**spec_kwargs))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return model


def parse_shape(text: str) -> tuple[str, dict]:
    """``LABEL:layers=2,hidden=128,...`` -> (label, ModelSpec kwargs)."""
    label, _, fields = text.partition(":")
    if not label or not fields:
        raise ValueError(f"--shape {text!r}: expected LABEL:layers=N,hidden=N,heads=N,"
                         "kv_heads=N,head_dim=N,ffn=N")
    kwargs: dict = {"arch": "qwen3"}
    window = pattern = None
    for item in fields.split(","):
        key, _, value = item.partition("=")
        if key == "arch":
            if value not in _ARCHS:
                raise ValueError(f"--shape {text!r}: arch {value!r} (choose from {', '.join(_ARCHS)})")
            kwargs["arch"] = value
        elif key == "window":
            window = int(value)
        elif key == "pattern":
            pattern = int(value)
        elif key in _SHAPE_KEYS:
            kwargs[_SHAPE_KEYS[key]] = int(value)
        else:
            raise ValueError(f"--shape {text!r}: unknown key {key!r} "
                             f"(choose from arch, window, pattern, {', '.join(_SHAPE_KEYS)})")
    missing = set(_SHAPE_KEYS.values()) - set(kwargs)
    if missing:
        raise ValueError(f"--shape {text!r}: missing {', '.join(sorted(missing))}")
    gemma = kwargs["arch"] == "gemma3_text"
    if (window is None) == gemma or (pattern is not None and not gemma):
        raise ValueError(f"--shape {text!r}: window=N (and pattern=P) go with "
                         "arch=gemma3_text, and only with it")
    if gemma:
        pattern = kwargs["num_layers"] if pattern is None else pattern
        if not 1 <= pattern <= kwargs["num_layers"]:
            raise ValueError(f"--shape {text!r}: pattern={pattern} must be 1..layers "
                             "(mlx-lm's gemma3_text reads the pattern-th layer's cache)")
        kwargs["sliding_window"] = window
        kwargs["sliding_window_pattern"] = pattern
    return label, kwargs


#: Options that say where this machine kept its files, not what was trained: left out of
#: the command a model dir records.
_WHERE = ("--work", "--out", "--pack-dir")


def recorded_command(argv: list[str]) -> str:
    """The command as ``training.json`` records it, without :data:`_WHERE` and their values."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _WHERE:
            skip = True
        elif not arg.startswith(tuple(f"{w}=" for w in _WHERE)):
            kept.append(arg)
    return " ".join(["python -m foretell_demo_train", *kept])


def other_weights_bytes(target_dir: Path, draft_dirname: str = "demo-draft") -> int:
    """Bytes of every shipped weight file beside the draft's (the budget is for all)."""
    family = Path(target_dir).parent
    return sum(f.stat().st_size for d in family.iterdir()
               if d.is_dir() and d.name != draft_dirname for f in d.glob("*.safetensors"))


def open_run(args, preset, headline: str):
    """The run of a command that trains against the shipped target ``args.target_dir``:
    seeded, its corpus collected and encoded with that target's tokenizer (a draft or head
    must share it). Returns the run and the target's dir."""
    import torch

    from .pipeline import Run, stage_prepare

    target_dir = Path(args.target_dir)
    run = Run(preset=preset, work=Path(args.work), out=Path(args.out), seed=args.seed,
              compile=False, roots=args.roots, t0=time.time())
    torch.manual_seed(args.seed)
    run.log(f"{headline}, target {target_dir}, cuda {torch.cuda.is_available()}")
    stage_prepare(run, tokenizer=target_dir / "tokenizer.json")
    return run, target_dir


def redraft(args) -> None:
    import torch

    from . import evaluate as ev
    from .export import export_quantized, quantized_size, state_numpy, write_training_json
    from .export_stage import choose_bits, versions, with_state
    from .models import ModelSpec, count_params
    from .pipeline import load_lm, require_draft_ratio, stage_lm
    from .presets import preset_from_args
    from .train import device

    preset = preset_from_args(args)
    if args.seq_len:
        preset.seq_len = args.seq_len
    shapes = [parse_shape(s) for s in args.shape]
    run, target_dir = open_run(args, preset, f"redraft: candidates "
                               f"{[label for label, _ in shapes]}, {args.minutes} min each")

    # The teacher is the shipped target, dequantized: the checkpoint the draft stage reads.
    teacher = shipped_target(target_dir)
    run.ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"spec": teacher.spec.to_dict(), "state": teacher.state_dict(), "train_config": None,
                "train": {"source": str(target_dir), "note": "the shipped target, dequantized"}},
               run.ckpt_dir / "target.pt")

    draft_train = dict(preset.train["draft"])
    if args.batch_size:
        draft_train["batch_size"] = args.batch_size
    budget = int(preset.size_budget_mib * MIB) - other_weights_bytes(target_dir)
    dev = device()
    tok, prep = run.load_prepared()
    windows = ev.heldout_windows(np.asarray(run.tokens("heldout")), preset.seq_len,
                                 preset.eval_windows)
    target_model = teacher.to(dev).eval()
    bpt = prep["heldout_bytes_per_token"]
    summary = {"target_dir": str(target_dir), "weights_budget_left_mib": round(budget / MIB, 3),
               "target": ev.lm_eval(target_model, windows, dev, preset.eval_batch, bpt),
               "candidates": {}}
    for label, kwargs in shapes:
        name = f"draft-{label}"
        preset.models[name] = kwargs
        preset.train[name] = dict(draft_train)
        preset.distill[name] = dict(preset.distill["draft"])
        stage_lm(run, name, args.minutes)
        model, ckpt = load_lm(run, name, dev)
        params = count_params(model)
        require_draft_ratio(preset, count_params(target_model), params)
        draft_state = state_numpy(model)
        measure = {"loss": {}, "size": {}, "metrics": {}}
        for bits in (None, *preset.bits_choices):
            m = ev.lm_eval(with_state(model, Q.roundtrip_state(draft_state, bits), dev),
                           windows, dev, preset.eval_batch, bpt)
            measure["loss"][bits], measure["metrics"][bits] = m["loss"], m
            measure["size"][bits] = quantized_size(draft_state, bits)
        chosen = choose_bits({name: {"loss": measure["loss"], "size": measure["size"]}},
                             budget, preset.bits_choices, preset.min_bits_gain, run.log)[name]
        shipped = with_state(model, Q.roundtrip_state(draft_state, chosen), dev)
        quality = {
            "params": params, "bits": chosen, "spec": ckpt["spec"],
            "heldout": {"bf16": measure["metrics"][None], "shipped": measure["metrics"][chosen]},
            "draft_teacher_forced": ev.draft_metrics(target_model, shipped, windows, dev,
                                                     preset.eval_batch, 4, 0.8),
            "draft_on_target_greedy_path": ev.greedy_path_acceptance(
                target_model, shipped, windows, dev, preset.gen_prompt_len, preset.gen_len,
                preset.gen_prompts, 4),
        }
        run.log(f"[{name}] {params:,} params, {chosen}-bit: " + json.dumps(
            {k: quality[k] for k in ("draft_teacher_forced", "draft_on_target_greedy_path")}))
        out = run.out / f"demo-draft-{label}"
        size = export_quantized(out, ModelSpec(**ckpt["spec"]), draft_state, chosen, tok,
                                prep["eos_id"])
        quality["weights_bytes"] = size
        write_training_json(out, {
            "command": recorded_command(args.argv),
            "seed": args.seed, "versions": versions(), "model": name, "arch": kwargs["arch"],
            "teacher": {"dir": str(target_dir), "note": "the shipped target, dequantized"},
            "corpus": prep["corpus"], "tokens": prep["tokens"], "tokenizer": prep["tokenizer"],
            "train_config": ckpt["train_config"], "train": ckpt["train"], **quality})
        summary["candidates"][label] = quality
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "redraft.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.pack_dir:
        from .pack import pack

        pack(run.out, Path(args.pack_dir), log=run.log,
             names=[f"demo-draft-{label}" for label, _ in shapes] + ["redraft.json"])
    run.log("finished")
