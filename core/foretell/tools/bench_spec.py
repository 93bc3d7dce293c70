"""Speculation rows for ``foretell bench --speculation``.

Every row runs on both sides in the same run, on the same weights and prompt ids:

| row | foretell | mlx-lm |
|---|---|---|
| ``plain`` (``plain-t0.8``) | plain decoding (sampled at 0.8) | the same |
| ``two-model`` | the two-model drafter, ``--draft-model`` | ``speculative_generate_step``, same draft |
| ``self`` | the target drafting for itself (upper bound) | the same, self-drafting |
| ``mtp`` | the target's MTP head (if it has one) | plain (mlx-lm has no MTP drafter) |
| ``plain-edit`` / ``ngram-edit`` | plain / prompt lookup on a code-editing prompt | plain |
| ``two-model-t0.8`` | sampled two-model, rejection, the adaptive length | speculative, temp 0.8 |
| ``two-model-t0.8-fixed`` / ``-match`` | the same at a fixed k, rejection / token-match | the same |
| ``mtp-t0.8`` | sampled MTP (the GPU's default drafter), the adaptive length | plain, temp 0.8 |

The code prompts are Python from the standard library (what the demo family was trained
on): ``code`` continues a module, ``edit`` asks to rewrite code that is in the prompt (the
output repeats it), where prompt lookup shines. ``benchmarks/spec_paired.py`` runs foretell's
rows alone, paired with plain decoding over more rounds.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

SAMPLED = 0.8
#: The MTP rows' shortlist head (``draft_vocab``) on a CPU: on the 2-core CPU the first
#: 2,048 ids drafted faster than 4,096, 8,192 or the whole 12,288-token head
#: (docs/speculation.md). GPUs draft from the whole head (0), where its size costs little.
MTP_DRAFT_VOCAB = 2048


def mtp_draft_vocab(job: dict[str, Any]) -> int:
    from foretell.spec.auto import machine_kind

    default = MTP_DRAFT_VOCAB if machine_kind() == "cpu" else 0
    value = job.get("mtp_draft_vocab")
    return default if value is None else value


_SPECULATORS: dict[tuple[Any, ...], Any] = {}
_MLX_DRAFTS: dict[str, Any] = {}


def drafted_up_to(kind: str) -> int | None:
    """The most tokens a round of this run's ``kind`` rows drafted (None: no such row)."""
    return next((s.max_tokens for key, s in _SPECULATORS.items() if key[0] == kind), None)


def code_prompts(tokenizer: Any, length: int) -> dict[str, list[int]]:
    """``code`` and ``edit`` prompts of about ``length`` tokens, as token ids."""
    import json.decoder
    import textwrap

    source = inspect.getsource(json.decoder)
    ids = tokenizer.encode(source, add_special_tokens=False)[:length]
    code = ids
    snippet = textwrap.dedent(inspect.getsource(json.decoder.JSONObject))
    body = tokenizer.encode(snippet, add_special_tokens=False)
    head = "# Same function, reformatted; behaviour unchanged.\n"
    lead = "\n".join(snippet.splitlines()[:2]) + "\n"
    tail = tokenizer.encode("\n\n" + head + lead, add_special_tokens=False)
    budget = max(length - len(tail), 16)
    edit = body[:budget] + tail
    return {"code": code, "edit": edit}


# -- foretell side ------------------------------------------------------------------------


def _speculator(engine: Any, job: dict[str, Any], kind: str, model: str | None = None,
                acceptance: str = "rejection", adaptive: bool = True,
                sampled: bool = False) -> Any:
    """One speculator per row kind, kept across rounds (its policy learns as a user's
    process would); greedy and sampled rows never share one, as their acceptance differs
    and the policy learns it."""
    from foretell.plugin.registry import Kind

    # The two-model rows draft what mlx-lm's rows are given; the others what their drafter
    # drafts unless told (``draft_tokens``: n-gram 16, MTP 6), or the job's override.
    tokens = job["num_draft_tokens"] if kind == "two-model" else job.get(f"{kind}_draft_tokens")
    key = (kind, model, acceptance, adaptive, sampled, tokens, mtp_draft_vocab(job))
    if key not in _SPECULATORS:
        config = engine.registry.get(Kind.DRAFT, kind).config
        options = config(model=model) if model is not None else (config() if config else None)
        if kind == "mtp":
            options = config(draft_vocab=mtp_draft_vocab(job))
        _SPECULATORS[key] = engine.use_draft(
            kind, options, max_tokens=tokens, acceptance=acceptance, adaptive=adaptive,
        )
        engine.use_draft(None)
    return _SPECULATORS[key]


def _foretell(engine: Any, prompt: list[int], max_tokens: int, speculate: Any,
              temp: float = 0.0):
    from foretell.config import SamplingConfig

    sampling = SamplingConfig(temp=temp, seed=0) if temp else None
    stats, started = None, time.perf_counter()
    for event in engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True,
                                 speculate=speculate, sampling=sampling):
        if event.type == "text" and event.tokens:
            yield len(event.tokens)
        elif event.type == "stats":
            stats = event
    spec = stats.speculation if stats is not None else None
    if not spec:
        return None
    policy = getattr(speculate, "policy", None)
    return {"acceptance": spec["acceptance"],
            "tokens_per_forward": spec["tokens_per_target_forward"],
            "mean_k": spec["mean_k"],
            "acceptance_by_position": spec["acceptance_by_position"],
            # What the draft-length policy went by after this run: each length's typical
            # round time (0: a plain step), ms, and its per-position acceptance estimates.
            "policy_round_ms": {k: t * 1e3 for k, t in policy.measured().items()}
            if policy is not None else None,
            "policy_acceptance": policy.acceptance() if policy is not None else None,
            # What it was told during this run (plain stretches: per step), with when.
            "policy_told": _told(policy, started) if policy is not None else None}


def _told(policy: Any, since: float) -> list[dict[str, Any]]:
    """The policy's observations since ``since`` (its newest TOLD_KEPT at most): tokens
    drafted (0: a plain stretch) and kept, ms (a plain stretch's per step), how the time was
    used, and ms before the newest one."""
    told = [t for t in policy.told if t[4] >= since]
    last = told[-1][4] if told else 0.0
    return [{"k": k, "kept": kept, "ms": s * 1e3, "use": use, "ago_ms": (last - at) * 1e3}
            for k, kept, s, use, at in told]


def sampled(row: str) -> bool:
    """Whether ``row`` samples at temperature 0.8 (on both sides) rather than greedily."""
    return "t0.8" in row


def foretell_runner(row: str):
    def run(engine: Any, prompt: list[int], max_tokens: int, job: dict[str, Any]):
        draft = job.get("draft_model")
        adaptive = job.get("adaptive", True)
        hot = sampled(row)
        if row in ("plain", "plain-edit", "plain-t0.8"):
            spec = False
        elif row == "two-model":
            spec = _speculator(engine, job, "two-model", draft, adaptive=adaptive)
        elif row == "self":
            spec = _speculator(engine, job, "two-model", job["model"], adaptive=adaptive)
        elif row in ("mtp", "mtp-t0.8"):
            # Sampled: what a sampled request gets by default on a GPU (rejection sampling).
            spec = _speculator(engine, job, "mtp", adaptive=adaptive, sampled=hot)
        elif row == "ngram-edit":
            spec = _speculator(engine, job, "ngram", adaptive=adaptive)
        elif row.startswith("two-model-t0.8"):
            # What a user's sampled request gets (the adaptive length), and at a fixed
            # length both acceptance rules, compared like for like.
            rule = "token-match" if row.endswith("-match") else "rejection"
            fixed = row != "two-model-t0.8"
            spec = _speculator(engine, job, "two-model", draft, rule,
                               adaptive=adaptive and not fixed, sampled=True)
        else:
            raise KeyError(row)
        return (yield from _foretell(engine, prompt, max_tokens, spec, SAMPLED if hot else 0.0))

    return run


# -- mlx-lm side --------------------------------------------------------------------------


def mlx_lm_drafts(row: str) -> bool:
    """Whether mlx-lm's side of ``row`` runs its speculative decoding (a draft model or the
    target drafting for itself) rather than plain decoding."""
    return row in ("two-model", "self") or row.startswith("two-model-t0.8")


def mlx_lm_runner(row: str):
    def run(loaded: Any, prompt: list[int], max_tokens: int, job: dict[str, Any]):
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        model, tokenizer = loaded
        kwargs: dict[str, Any] = {}
        draft = None
        if mlx_lm_drafts(row):
            draft = model if row == "self" else _mlx_draft(job["draft_model"])
        if draft is not None:
            kwargs.update(draft_model=draft, num_draft_tokens=job["num_draft_tokens"])
        if sampled(row):
            kwargs["sampler"] = make_sampler(temp=SAMPLED)
        total = drafted = 0
        for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                        **kwargs):
            total += 1
            drafted += bool(getattr(response, "from_draft", False))
            yield 1
        return {"from_draft": drafted / total} if draft is not None and total else None

    return run


def _mlx_draft(path: str) -> Any:
    if path not in _MLX_DRAFTS:
        from mlx_lm import load

        from foretell.engine import resolve_model_path

        _MLX_DRAFTS[path] = load(str(resolve_model_path(path)))[0]
    return _MLX_DRAFTS[path]


def runnable(model: Any, rows: list[str], draft_model: str | None) -> list[str]:
    """The rows this target can run: MTP needs its head, two-model a draft of its vocabulary."""
    import json
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    draft_vocab = None
    if draft_model is not None:
        draft_vocab = json.loads((Path(draft_model) / "config.json").read_text()).get("vocab_size")
    keep = []
    for row in rows:
        if row.startswith("mtp") and not isinstance(config.get("mtp_config"), dict):
            continue
        if row.startswith("two-model") and draft_vocab != config.get("vocab_size"):
            continue
        keep.append(row)
    return keep


#: Row -> which prompt it runs on.
ROWS = {
    "plain": "code",
    "two-model": "code",
    "self": "code",
    "mtp": "code",
    "plain-edit": "edit",
    "ngram-edit": "edit",
    "plain-t0.8": "code",
    "two-model-t0.8": "code",
    "two-model-t0.8-fixed": "code",
    "two-model-t0.8-match": "code",
    "mtp-t0.8": "code",
}


def plain_row(row: str) -> str:
    """The plain-decoding row a speculation row is compared with: same prompt, same
    sampling."""
    if ROWS.get(row) == "edit":
        return "plain-edit"
    return "plain-t0.8" if sampled(row) else "plain"
