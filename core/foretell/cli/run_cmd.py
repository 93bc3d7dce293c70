"""``foretell run``: complete one prompt, streaming the text, then report speed.

Flags keep mlx-lm's names. Every run setting also lives in the TOML run config
(``--config FILE``); a flag overrides the file. Text goes to stdout and the speed report
to stderr, so ``foretell run > out.txt`` captures only the completion. ``--json`` prints one
JSON object per line: ``{"type": "text", ...}`` events, then ``{"type": "stats", ...}``.

Chat template: ``run`` completes text, so the prompt goes in raw unless ``--chat`` (or
``chat = true`` in the config) asks for the model's template; ``foretell chat`` always
uses it (docs/decisions.md). On a terminal the prompt is echoed, dimmed, before the
completion; piped output and ``--json`` carry only what the model generated.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from foretell.errors import ConfigError

#: What the shipped demo model (trained on Python source) completes when no prompt is given.
#: No trailing newline: the tokenizer merges a newline with the next line's indentation, so
#: a prompt ending in a bare newline asks the model to continue from a split token.
DEFAULT_PROMPT = "def fibonacci(n):"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="generate a completion for one prompt")
    add_run_flags(p)
    p.add_argument(
        "text",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt, as --prompt takes it (give it one way or the other)",
    )
    p.add_argument(
        "--prompt",
        "-p",
        default=None,
        help="the prompt; '-' reads it from stdin; \\n and \\t are unescaped "
        "(default: a Python snippet)",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the model's chat template to the prompt (default: off, complete raw text)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end generation at TEXT, which is not printed; \\n and \\t are unescaped "
        "(repeatable; default: none, the model's end-of-sequence tokens end it)",
    )
    p.add_argument("--json", action="store_true", help="print JSON lines: text events, then stats")
    p.add_argument(
        "--policy-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the adaptive draft length from what the last run of this model, drafter "
        "and device learned, and keep what this one learns (a small file under "
        "$XDG_CACHE_HOME/foretell/draft-policy; docs/speculation.md) (default: on)",
    )
    p.set_defaults(handler=run)


def add_run_flags(p: argparse.ArgumentParser, *, resume: bool = True) -> None:
    """The flags ``run`` and ``chat`` share; each maps onto a field of the run config.
    ``resume``: offer ``--resume`` (``run`` only: a chat's conversation lives in its
    process, so there is no identical command to rerun)."""
    p.add_argument(
        "--model", "-m", default=None, help="model directory or shipped model name (default: demo)"
    )
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="a TOML run config; flags override it (default: none, the defaults shown here)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens to generate (default: 256)"
    )
    p.add_argument(
        "--temp", type=float, default=None, help="sampling temperature; 0 is greedy (default: 0)"
    )
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling mass (default: 1, off)"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely (default: 0, off)"
    )
    p.add_argument(
        "--min-p", type=float, default=None,
        help="drop tokens below min-p x the top probability (default: 0, off)"
    )
    p.add_argument(
        "--seed", type=int, default=None,
        help="random seed; the same seed reproduces the run, with any drafter or none "
             "(docs/speculation.md) (default: none, a fresh draw each run)"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="penalize recent tokens (default: 1, off)",
    )
    p.add_argument(
        "--repetition-context-size",
        type=int,
        default=None,
        help="how many recent tokens the penalty sees (default: 20)",
    )
    p.add_argument(
        "--model-stops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end each completion at the stop strings the model declares (stop_strings in its "
        "generation_config.json; the demo models end one top-level Python unit; default: on)",
    )
    p.add_argument("--draft", default=None, metavar="KIND",
                   help="speculative decoding with this draft provider (see `foretell plugins`); "
                   "'none' turns it off; default 'auto': the drafter measured best for the "
                   "model on this kind of machine, if it names one")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="draft with this model (a directory or shipped name): --draft two-model "
                   "(default: none)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="the most tokens drafted per round (default: the model's measured "
                   "best in its speculation.json, else the drafter's own: two-model 4, mtp 6, "
                   "ngram 16; the adaptive length chooses below it)")
    p.add_argument("--draft-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of the draft provider, e.g. max_ngram=3 (repeatable; "
                   "default: the provider's own)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="keep computed prompt prefixes on disk here and reuse them; a URL "
                   "(redis://HOST:PORT/DB with foretell-redis) keeps them in the store it "
                   "names, shared with other processes (default: none, nothing is kept)")
    p.add_argument("--cache-max-gb", type=float, default=None, metavar="N",
                   help="byte cap of this model's entries in the cache directory (per KV scheme), "
                        "GiB (default: 32)")
    p.add_argument("--cache-layout", default=None, metavar="NAME",
                   help="storage layout of the cache directory (see `foretell plugins`; "
                   "default: blocks)")
    p.add_argument("--kv-bits", type=int, default=None, metavar="N",
                   help="quantize the KV cache to 4 or 8 bits (default: off)")
    if resume:
        p.add_argument("--resume", action="store_const", const=True, default=None,
                       help="checkpoint the generation; rerun the same command after a crash "
                       "to continue it (needs --cache-dir)")


_FLAG_FIELDS = {
    "model": "model",
    "max_tokens": "max_tokens",
    "chat": "chat",
    "temp": "sampling.temp",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "repetition_penalty": "sampling.repetition_penalty",
    "repetition_context_size": "sampling.repetition_context_size",
    "cache_dir": "cache.dir",
    "cache_max_gb": "cache.max_gb",
    "cache_layout": "cache.layout",
    "kv_bits": "cache.kv_bits",
    "resume": "cache.resume",
}


def run_config(args: argparse.Namespace, more: dict[str, tuple[Any, str]] | None = None):
    """The plugin registry and the run config from ``--config`` plus flags; ``more``: a
    command's own overrides (``{"serve.port": (8080, "--port")}``)."""
    from foretell.config import load_run_config
    from foretell.plugin.loader import load_plugins

    overrides = {}
    for attr, field in _FLAG_FIELDS.items():
        if hasattr(args, attr):
            overrides[field] = (getattr(args, attr), "--" + attr.replace("_", "-"))
    overrides.update(draft_overrides(args))
    overrides.update(more or {})
    registry = load_plugins().registry
    config = load_run_config(registry, args.config, overrides)
    if config.cache.dir is None:
        _refuse_disk_settings_without_a_directory(args, config)
    return registry, config


def _refuse_disk_settings_without_a_directory(args: argparse.Namespace, config: Any) -> None:
    """Settings of the SSD tier given where there is none would be ignored in silence:
    ``--resume`` (or ``[cache] resume``), ``--cache-max-gb`` and ``--cache-layout``. A
    config file's ``max_gb`` or ``layout`` alone is allowed: it may hold the defaults for
    runs that name the directory on the command line."""
    problems = []
    if config.cache.resume and hasattr(args, "resume"):  # a chat ignores it (chat_cmd)
        problems.append("cache.resume: needs a cache directory (--cache-dir DIR)")
    for flag, field in (("cache_max_gb", "max_gb"), ("cache_layout", "layout")):
        if getattr(args, flag, None) is not None:
            problems.append(f"cache.{field}: needs a cache directory (--cache-dir DIR), "
                            f"set by --{flag.replace('_', '-')}")
    if problems:
        raise ConfigError(args.config or "command line", problems)


def draft_overrides(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """``[draft]`` fields set by ``--draft``, ``--draft-model``, ``--num-draft-tokens`` and
    ``--draft-option KEY=VALUE`` (VALUE read as a TOML value, else as a string)."""
    from foretell.config import tomllib

    out: dict[str, tuple[Any, str]] = {}
    if getattr(args, "draft", None) is not None:
        out["draft.kind"] = (args.draft, "--draft")
    if getattr(args, "draft_model", None) is not None:
        if getattr(args, "draft", None) in (None, "auto"):
            out["draft.kind"] = ("two-model", "--draft-model")
        out["draft.model"] = (args.draft_model, "--draft-model")
    if getattr(args, "num_draft_tokens", None) is not None:
        out["draft.num_tokens"] = (args.num_draft_tokens, "--num-draft-tokens")
    for item in getattr(args, "draft_option", None) or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("command line", [f"--draft-option {item!r}: expected KEY=VALUE"])
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[f"draft.{key.strip()}"] = (value, "--draft-option")
    return out


def apply_draft(engine: Any, section: Any, registry: Any, *, quiet: bool = True) -> None:
    """Speculate as ``[draft]`` says: a named provider, ``none``, or ``auto`` (unset).
    ``quiet`` False shows a progress line while the drafter is prepared (on CUDA its
    warm-up compiles kernels: minutes on a machine's first run)."""
    from foretell.config import DRAFT_AUTO, DRAFT_NONE, DraftSettings
    from foretell.spec.auto import measured_drafter

    kind = section.kind if section is not None else DRAFT_AUTO
    settings = section.settings if section is not None else DraftSettings()
    options = section.options if section is not None else None
    num_tokens = settings.num_tokens
    sampled = True  # a drafter the user names speculates on every request
    if kind == DRAFT_NONE:
        engine.use_draft(None)  # an engine that speculated before stops
        return
    if kind == DRAFT_AUTO:
        chosen = measured_drafter(engine.path, registry)
        if chosen is None:
            engine.use_draft(None)
            return
        kind, options, sampled = chosen.kind, chosen.options, chosen.sampled
        num_tokens = num_tokens or chosen.num_tokens  # the user's own setting wins
    from foretell.cli.progress import ProgressLine

    with ProgressLine.for_terminal(f"preparing the {kind} drafter", quiet=quiet) as bar:
        engine.use_draft(kind, options, max_tokens=num_tokens,
                         adaptive=settings.adaptive, acceptance=settings.acceptance,
                         progress=bar, sampled=sampled)


def open_engine(model: str | None, registry: Any, *, quiet: bool, cache: Any = None,
                ram_cache: bool = False):
    """Load the model once, with a progress line while a person waits; with a ``[cache]``
    section, its KV scheme and a cache tier (RAM only unless it names a directory)."""
    from foretell.platform import blas

    blas.preload()  # before anything below imports mlx (docs/blas.md)
    from foretell.cli.progress import ProgressLine
    from foretell.engine import load

    path = model_path(model)  # a bad name fails before anything heavy
    if not quiet:
        from foretell.platform.device import cold_cuda_note

        note = cold_cuda_note()
        if note:
            print(note, file=sys.stderr)
    kv_bits = cache.kv_bits if cache is not None else None
    with ProgressLine.for_terminal(f"loading {path.name}", quiet=quiet) as bar:
        engine = load(path, registry=registry, progress=bar, kv_bits=kv_bits)
    if cache is not None and (cache.dir is not None or ram_cache):
        from foretell.cache.tier import CacheTier

        engine.cache = CacheTier.from_section(engine, cache)
    return engine


def model_path(model: str | None, flag: str = "--model"):
    """The model directory ``--model`` names; a bad name is an error naming the flag."""
    from foretell.engine import resolve_model_path
    from foretell.errors import ModelNotFound

    try:
        return resolve_model_path(model)
    except ModelNotFound as exc:
        raise ModelNotFound(exc.name, exc.reason, flag=flag) from None


def read_prompt(value: str, source: str = "--prompt") -> str:
    """The prompt ``value`` says (``-``: stdin), unescaped; errors name ``source``."""
    from foretell.cli import text

    if value == "-":
        return text.read_stdin(f"{source} -")
    return text.unescape(text.checked(value, source))


def given_prompt(args: argparse.Namespace) -> str:
    """The prompt as typed: the argument or ``--prompt`` (the demo's snippet without either).

    :raises ConfigError: both were given.
    """
    if args.text is not None and args.prompt is not None:
        raise ConfigError("prompt", [f"given twice: as an argument ({args.text!r}) and with "
                                     f"--prompt ({args.prompt!r}); give one"])
    if args.text is not None:
        return read_prompt(args.text, "the PROMPT argument")
    return read_prompt(DEFAULT_PROMPT if args.prompt is None else args.prompt)


def run(args: argparse.Namespace) -> int:
    from foretell.cli import text

    prompt = given_prompt(args)
    stops = [text.unescape(text.checked(s, "--stop")) for s in args.stop]
    registry, config = run_config(args)
    engine = open_engine(config.model, registry, quiet=args.json, cache=config.cache)
    stops += model_stops(engine, args)
    apply_draft(engine, config.draft, registry, quiet=args.json)
    warn_past_context(engine, engine.encode_prompt(prompt, chat=config.chat), config.max_tokens)
    from foretell.spec import memory

    remembered = (memory.remember(engine, sampled=config.sampling.temp > 0)
                  if args.policy_memory else None)
    from foretell.cli.progress import ProgressLine
    from foretell.request import PREFILL_CHUNK

    bar = ProgressLine.for_terminal("prefill", quiet=args.json)

    def prefill_progress(done: int, total: int) -> None:
        if total > PREFILL_CHUNK:  # a short prompt is done before a bar could be read
            bar.update(done, total)

    events = engine.generate(
        prompt,
        max_tokens=config.max_tokens,
        sampling=config.sampling,
        stop=stops,
        chat=config.chat,
        prefill_progress=prefill_progress,
        resume=config.cache.resume,
    )
    out = sys.stdout
    if not args.json and out.isatty():
        out.write(f"{DIM}{prompt}{UNDIM}" + ("\n" if config.chat else ""))
        out.flush()
    stats = None
    from foretell.cli.cache_cmd import flushing

    with flushing(engine.cache, quiet=args.json):
        for event in events:
            if event.type == "stats":
                stats = event
            bar.close()
            if args.json:
                out.write(json.dumps(event.to_dict(), ensure_ascii=False) + "\n")
                out.flush()
            elif event.type == "text" and event.text:
                out.write(event.text)
                out.flush()
    if remembered is not None:
        memory.store(engine.speculator.policy, remembered)
    if not args.json:
        out.write("\n")
        out.flush()
        report(stats)
        if stats.finish_reason == "stop" and not args.stop and model_stops(engine, args):
            from foretell.tokenizer import GENERATION_CONFIG_FILE

            print(f"Stopped at a stop string of {engine.path / GENERATION_CONFIG_FILE} "
                  "(--no-model-stops goes on to --max-tokens)", file=sys.stderr)
    return 0


def model_stops(engine: Any, args: argparse.Namespace) -> list[str]:
    """The stop strings the model declares, unless ``--no-model-stops``."""
    return list(engine.tokenizer.stop_strings) if args.model_stops else []


#: ANSI faint / normal intensity: the echoed prompt reads apart from the completion.
DIM, UNDIM = "\x1b[2m", "\x1b[22m"


def context_length(path: Any) -> int | None:
    """The positions the model was trained for (``max_position_embeddings``), if it says."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def warn_past_context(engine: Any, prompt_ids: list[int], max_tokens: int) -> bool:
    """One line on stderr when the prompt plus ``--max-tokens`` runs past the model's
    context: generation continues, but past it the model's output is not to be trusted."""
    limit = context_length(engine.path) if engine.path is not None else None
    if limit is None or len(prompt_ids) + max_tokens <= limit:
        return False
    print(
        f"foretell: warning: --max-tokens {max_tokens} with a {len(prompt_ids)}-token prompt "
        f"runs past the model's context of {limit} tokens (max_position_embeddings in "
        f"{engine.path / 'config.json'}); output beyond it is unreliable",
        file=sys.stderr,
    )
    return True


def report(stats: Any) -> None:
    """The speed report, on stderr (mlx-lm's layout)."""
    print("=" * 10, file=sys.stderr)
    computed = stats.prompt_tokens - stats.cached_tokens
    if computed <= 0:
        speed = f"none computed (all from the {stats.cached_from})"
    elif stats.cached_tokens:  # the speed is of the tokens computed, not of the cached ones
        speed = f"{stats.prompt_tps:.3f} tokens-per-sec over the {computed} computed"
    else:
        speed = f"{stats.prompt_tps:.3f} tokens-per-sec"
    print(f"Prompt: {stats.prompt_tokens} tokens, {speed}", file=sys.stderr)
    print(
        f"Generation: {stats.generated_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec",
        file=sys.stderr,
    )
    if stats.cached_tokens:
        print(f"Cached: {stats.cached_tokens} prompt tokens ({stats.cached_from})", file=sys.stderr)
    if stats.resumed_tokens:
        print(f"Resumed: {stats.resumed_tokens} generated tokens restored from the checkpoint "
              "(not in the generation speed)", file=sys.stderr)
    if (line := speculation_line(stats)) is not None:
        print(f"Speculation: {line}", file=sys.stderr)
    print(f"TTFT: {stats.ttft_s:.3f} s", file=sys.stderr)
    print(f"Peak memory: {stats.peak_memory_gb:.3f} GB", file=sys.stderr)


def speculation_line(stats: Any) -> str | None:
    """What the drafter did for a request, in words (None when it did not speculate)."""
    spec = stats.speculation
    if not spec:
        return None
    return (f"{spec['drafter']}, {spec['accepted']} of {spec['drafted']} drafts accepted, "
            f"{spec['tokens_per_target_forward']:.2f} tokens per target forward, "
            f"mean draft length {spec['mean_k']:.2f}")
