"""Model shapes and training settings. ``full`` is the shipped family (GPU host); ``tiny``
is the CPU smoke-test configuration (runs end to end in well under two minutes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Preset:
    vocab_candidates: list[int]
    vocab_tolerance: float
    tokenizer_sample_bytes: int
    seq_len: int
    models: dict[str, dict]  # name -> ModelSpec kwargs (without arch/vocab)
    train: dict[str, dict]  # name -> TrainConfig kwargs (without budget_s)
    budgets_min: dict[str, float]
    eval_windows: int
    eval_batch: int
    gen_prompts: int
    gen_prompt_len: int
    gen_len: int
    completion_tokens: int
    max_files: int | None = None
    # name -> {"teacher": model name, "ce_weight": w}: train against the frozen teacher's
    # distribution (see models.distill_loss); w = 1.0 is plain cross-entropy
    distill: dict[str, dict] = field(default_factory=dict)
    min_target_draft_ratio: float = 8.0
    size_budget_mib: float = 32.0
    bits_choices: tuple[int, ...] = (4, 8)
    min_bits_gain: float = 0.002  # nats of held-out loss an upgrade must buy
    notes: list[str] = field(default_factory=list)


FULL = Preset(
    vocab_candidates=[8192, 12288, 16384],
    vocab_tolerance=0.02,
    tokenizer_sample_bytes=48_000_000,
    seq_len=512,
    models={
        "target": dict(arch="qwen3", hidden_size=512, num_layers=6, num_heads=8,
                       num_kv_heads=4, head_dim=64, intermediate_size=1536),
        # Two layers, the lower one sliding: on a GPU a draft's depth sets its cost, and a
        # shallow all-global draft attends badly past its training windows (redraft.py).
        "draft": dict(arch="gemma3_text", hidden_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, intermediate_size=1024,
                      sliding_window=512, sliding_window_pattern=2),
        "gemma": dict(arch="gemma3_text", hidden_size=384, num_layers=6, num_heads=6,
                      num_kv_heads=2, head_dim=64, intermediate_size=1024,
                      sliding_window=256, sliding_window_pattern=3, rope_theta=1_000_000.0),
    },
    train={
        "target": dict(lr=2e-3, batch_size=128, warmup_steps=150),
        "draft": dict(lr=4e-3, batch_size=128, warmup_steps=100),
        "mtp": dict(lr=1.5e-3, batch_size=128, warmup_steps=50),
        "gemma": dict(lr=2e-3, batch_size=128, warmup_steps=150),
    },
    budgets_min={"target": 3.5, "draft": 2.25, "mtp": 1.0, "gemma": 1.75},
    distill={"draft": {"teacher": "target", "ce_weight": 0.0}},
    eval_windows=512,
    eval_batch=64,
    gen_prompts=64,
    gen_prompt_len=128,
    gen_len=64,
    completion_tokens=64,
)

TINY = Preset(
    vocab_candidates=[768, 1024],
    vocab_tolerance=0.02,
    tokenizer_sample_bytes=1_500_000,
    seq_len=64,
    models={
        "target": dict(arch="qwen3", hidden_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=32, intermediate_size=128),
        "draft": dict(arch="qwen3", hidden_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32, intermediate_size=64),
        "gemma": dict(arch="gemma3_text", hidden_size=64, num_layers=3, num_heads=2,
                      num_kv_heads=1, head_dim=32, intermediate_size=128,
                      sliding_window=16, sliding_window_pattern=3, rope_theta=1_000_000.0),
    },
    train={
        "target": dict(lr=3e-3, batch_size=16, warmup_steps=10),
        "draft": dict(lr=3e-3, batch_size=16, warmup_steps=10),
        "mtp": dict(lr=3e-3, batch_size=16, warmup_steps=10),
        "gemma": dict(lr=3e-3, batch_size=16, warmup_steps=10),
    },
    budgets_min={"target": 0.1, "draft": 0.05, "mtp": 0.05, "gemma": 0.05},
    distill={"draft": {"teacher": "target", "ce_weight": 0.0}},
    eval_windows=16,
    eval_batch=16,
    gen_prompts=4,
    gen_prompt_len=16,
    gen_len=8,
    completion_tokens=8,
    max_files=240,
    min_target_draft_ratio=0.0,
    notes=["tiny smoke-test configuration: shapes and numbers are not meaningful"],
)

PRESETS = {"full": FULL, "tiny": TINY}


def preset_from_args(args) -> Preset:
    """The preset ``--preset`` names, with the overrides every subcommand shares applied
    (``--max-files``, ``--eval-windows``, ``--gen-prompts``)."""
    preset = PRESETS[args.preset]
    if args.max_files is not None:
        preset.max_files = args.max_files or None
    if args.eval_windows:
        preset.eval_windows = args.eval_windows
    if args.gen_prompts:
        preset.gen_prompts = args.gen_prompts
    return preset
