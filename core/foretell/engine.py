"""The generation engine integrators call: load once, generate many.

    engine = foretell.load("demo")
    for event in engine.generate("Tell me a story", max_tokens=64):
        if event.type == "text":
            print(event.text, end="", flush=True)
    print(event.to_dict())  # the final event carries the stats

Every request, ``generate``'s too, is submitted to the engine's one scheduler
(:mod:`foretell.scheduler`), whose worker thread owns MLX: encode (chat template) -> admit
(the prefix cache slots in here) -> prefill all but the last prompt token in 2048-token
chunks -> steps over every running request, each handing back one or more token ids per
request (a speculating request's drafts verified in the same forward,
:func:`foretell.spec.batch.verify_rows`) -> EOS, stop strings and ``max_tokens`` ->
streamed text -> final stats (:mod:`foretell.stream`). ``generate`` is submit-and-iterate.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx

from foretell.concurrency import mlx_work
from foretell.config import EngineSettings
from foretell.errors import ConfigError, GenerationError, ModelNotFound
from foretell.model.kvcache import KVCache
from foretell.platform import device
from foretell.request import Progress, RequestState
from foretell.stream import Event, Stats
from foretell.tokenizer import Tokenizer

if TYPE_CHECKING:
    from foretell.cache.request import RequestCache
    from foretell.cache.tier import CacheTier
    from foretell.config import SamplingConfig
    from foretell.model import Model
    from foretell.plugin.registry import Registry
    from foretell.scheduler import RequestHandle, Scheduler
    from foretell.spec import Speculator, Target

#: The shipped model ``--model`` means when none is named.
DEFAULT_MODEL = "demo"
DEMO_DIR = Path(__file__).parent / "demo"

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


# -- which model --------------------------------------------------------------------------


def shipped_models() -> list[str]:
    """Names of the demo models shipped inside the package."""
    if not DEMO_DIR.is_dir():
        return []
    return sorted(p.name for p in DEMO_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """A model directory: a directory as given, else a shipped model's name. What is no
    model (a folder without ``config.json``, a file: say a folder of one's own called
    ``demo``) does not shadow the shipped model of its name."""
    name = os.fspath(model) if model is not None else DEFAULT_MODEL
    path = Path(name).expanduser()
    shipped = shipped_models()
    if path.is_dir() and ((path / "config.json").is_file() or name not in shipped):
        return path
    if name in shipped:
        return DEMO_DIR / name
    if path.exists():
        raise ModelNotFound(name, "is a file; give the model's directory")
    listing = ", ".join(shipped) if shipped else "none are installed"
    raise ModelNotFound(
        name, f"no such directory and no shipped model of that name (shipped models: {listing})"
    )


class Engine:
    """A loaded model and tokenizer, ready to serve requests.

    Any thread may use it: every request runs on the scheduler's one worker thread, beside
    the others (:meth:`submit`), and a generation may be iterated on another thread than the
    one that started it."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        registry: Registry | None = None,
        path: Path | None = None,
        speculator: Speculator | None = None,
        cache: CacheTier | str | os.PathLike[str] | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        settings: EngineSettings | None = None,
    ):
        """``cache``: a tier (engines of one model may share one), or a cache directory to
        open one in for this engine (``CacheTier.for_engine``: the default layout, RAM and
        SSD caps), so an integrator need not import the tier (which imports MLX) before
        :func:`load` binds the CPU's BLAS. ``settings``: this engine's path choices
        (default: the environment's and the device's)."""
        self.model = model
        self.tokenizer = tokenizer
        self.registry = registry
        self.path = path
        #: Affine-quantized KV for full-attention layers (4 or 8 bits; None: unquantized).
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        if kv_bits is not None and not any(type(c) is KVCache for c in model.make_caches()):
            # Asked for quantized KV (to fit memory, say) where none applies: say so.
            raise ConfigError("kv_bits", [
                f"{model.model_type}: no layer of this model keeps a KV cache foretell can "
                f"quantize (its caches: {sorted({type(c).__name__ for c in model.make_caches()})}"
                f"), so kv_bits={kv_bits} would change nothing; leave it out"])
        self._cache: CacheTier | None = None
        #: Path choices for this engine's work (:class:`~foretell.config.EngineSettings`).
        self.settings = settings if settings is not None else EngineSettings()
        if isinstance(cache, (str, os.PathLike)):
            from foretell.cache.tier import CacheTier

            duty = self.settings.spill_duty
            cache = CacheTier.for_engine(self, cache,
                                         **({"spill_duty": duty} if duty is not None else {}))
        self.cache = cache
        #: The drafter requests use by default (None: plain decoding); see :meth:`use_draft`.
        self.speculator = speculator

    @property
    def cache(self) -> CacheTier | None:
        """The prefix cache tier (RAM, optional SSD); engines of one model may share one.

        :raises ConfigError: on assignment, a tier holding another model's states (another
            config, weights or tokenizer) or another KV scheme's."""
        return self._cache

    @cache.setter
    def cache(self, tier: CacheTier | None) -> None:
        reason = tier.mismatch(self) if tier is not None else None
        if reason is not None:
            raise ConfigError("engine.cache", [reason])
        self._cache = tier

    @property
    def target(self) -> Target:
        from foretell.spec import Target

        return Target(model=self.model, tokenizer=self.tokenizer, path=self.path,
                      registry=self.registry)

    def use_draft(
        self,
        kind: str | None,
        options: Any = None,
        *,
        max_tokens: int | None = None,
        adaptive: bool = True,
        acceptance: str = "rejection",
        progress: Progress | None = None,
        sampled: bool = True,
    ) -> Speculator | None:
        """Speculate with the draft provider registered as ``kind`` (None: stop speculating).

        The pairing is checked and the draft weights are loaded now, once; every later
        request uses them. ``options`` is an instance of the provider's config class;
        ``max_tokens`` None drafts the provider's own preferred length (two-model 4, MTP 6,
        n-gram 16). ``progress(done, total)`` hears of the warm-up's steps where the device compiles
        kernels per shape (:mod:`foretell.spec.warmup`). ``sampled`` False speculates on greedy
        requests only; sampled ones decode plainly.
        """
        if kind is None:
            self.speculator = None  # requests already submitted keep theirs
            return None
        from foretell.spec import make_speculator
        from foretell.spec.warmup import warm_up

        if self.registry is None:
            raise GenerationError("this engine has no plugin registry to find drafters in")
        with mlx_work(), self.settings.active():
            speculator = make_speculator(
                self.registry, self.target, kind, options,
                max_tokens=max_tokens, adaptive=adaptive, acceptance=acceptance, sampled=sampled,
            )
        # The warm-up's requests run on the scheduler's worker, as every request does: this
        # thread only waits for them (holding MLX here would stall that worker for good).
        warm_up(self, speculator, progress)
        self.speculator = speculator
        return speculator

    # -- prompts --

    def encode_prompt(self, prompt: Prompt, *, chat: bool | None = False) -> list[int]:
        """Token ids for a prompt: text, a list of chat messages, or ids as they are.

        Text goes in raw, as mlx-lm's Python ``generate`` takes it, unless ``chat`` is true
        (``None`` is read as false); messages always go through the chat template.
        """
        tok = self.tokenizer
        if isinstance(prompt, str):
            if chat:
                return self._encode_chat([{"role": "user", "content": prompt}])
            # A prompt that spells out BOS itself must not get a second one.
            leads_with_bos = tok.bos_token is not None and prompt.startswith(tok.bos_token)
            return tok.encode(prompt, add_special_tokens=not leads_with_bos)
        items = list(prompt)
        if items and all(isinstance(m, Mapping) for m in items):
            return self._encode_chat(items)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise GenerationError(
                "a prompt is text, a list of chat messages, or a list of token ids"
            )
        vocab = self.model.vocab_size
        bad = [i for i in items if not 0 <= i < vocab]
        if bad:
            raise GenerationError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        return items

    def _encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template writes BOS itself where the model wants one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation --

    def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        sampling: SamplingConfig | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = False,
        prefill_progress: Progress | None = None,
        ignore_eos: bool = False,
        speculate: bool | Speculator = True,
        resume: bool = False,
    ) -> Iterator[Event]:
        """Stream a completion: :class:`TextEvent` s, then one :class:`Stats`. The request
        is submitted now (:meth:`submit`) and runs on the scheduler's worker, which does not
        wait for this iterator; closing or dropping the iterator before its end cancels it.

        :param prompt: text, chat messages (``[{"role": ..., "content": ...}]``) or token ids.
        :param max_tokens: the most tokens to generate (EOS counts).
        :param sampling: how tokens are chosen; default greedy.
        :param stop: strings that end generation; never emitted.
        :param chat: apply the chat template to a text prompt (default: raw text, as mlx-lm's
            Python ``generate``; chat messages always use the template).
        :param prefill_progress: called ``(tokens done, tokens total)`` after each prefill
            chunk, on the scheduler's worker thread.
        :param ignore_eos: keep generating through EOS to ``max_tokens`` (benchmarks).
        :param speculate: use the engine's drafter (True), decode plainly (False), or use
            this :class:`~foretell.spec.Speculator`. Speculation never changes greedy output.
        :param resume: checkpoint this request as it goes and, if an earlier identical request
            (same prompt and settings) was interrupted, continue it from its last checkpoint
            (needs a cache with an SSD tier).
        """
        handle = self.submit(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop,
                             chat=chat, prefill_progress=prefill_progress,
                             ignore_eos=ignore_eos, speculate=speculate, resume=resume)
        return _Events(handle)

    def submit(self, prompt: Prompt, **options: Any) -> RequestHandle:
        """Queue a request beside others: many requests decode together in one forward on
        one worker thread (:mod:`foretell.scheduler`), each with its own drafter, sampling
        and stop rules. Returns a :class:`~foretell.scheduler.RequestHandle` that yields the
        events :meth:`generate` yields (from any thread, or ``async for`` over
        ``handle.events()``) and can be cancelled. ``options`` as for :meth:`generate`,
        plus ``logprobs`` and ``constraint``."""
        return self.scheduler.submit(prompt, **options)

    @functools.cached_property
    def scheduler(self) -> Scheduler:
        """This engine's batch scheduler (made on first use; ``Scheduler(engine, ...)``
        makes one with other limits)."""
        from foretell.scheduler import Scheduler

        return Scheduler(self)

    def generate_text(self, prompt: Prompt, **options: Any) -> str:
        """The whole completion as one string; ``options`` as for :meth:`generate`."""
        return "".join(e.text for e in self.generate(prompt, **options) if e.type == "text")

    @functools.cached_property
    def context_length(self) -> int | None:
        """The positions the model was trained for: ``max_position_embeddings`` of its
        ``config.json`` (or its ``text_config``), as far as a RoPE scaling factor extends it;
        None when the engine has no model directory or its config does not say."""
        import json

        try:
            config = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
        except (TypeError, OSError, ValueError):  # no path, no file, no JSON
            return None
        if not isinstance(config, dict):
            return None
        text = config.get("text_config")
        config = {**(text if isinstance(text, dict) else {}), **config}
        positions = config.get("max_position_embeddings")
        if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
            return None
        scaling = config.get("rope_scaling") or {}
        factor = scaling.get("factor") if isinstance(scaling, Mapping) else None
        if isinstance(factor, (int, float)) and factor > 1:
            original = scaling.get("original_max_position_embeddings") or positions
            positions = max(positions, int(original * factor))
        return positions

    def _check_fits(self, prompt_tokens: int) -> None:
        """Refuse, before anything is allocated, a prompt longer than the model's context:
        its prefill would run out of memory long before the output meant anything."""
        limit = self.context_length
        if limit is not None and prompt_tokens > limit:
            raise GenerationError(
                f"a {prompt_tokens:,}-token prompt does not fit the model's {limit:,}-token "
                f"context (max_position_embeddings in {self.path / 'config.json'}): at most "
                f"{limit:,} prompt tokens fit; shorten the prompt")

    @functools.cached_property
    def compute_dtype(self) -> str:
        """The floating dtype the model computes in, and so its KV: the widest of its
        parameters' (a quantized model unpacked on the CPU computes in float32, packed in
        its scales' bfloat16). Cached entries are namespaced by it: the same model's KV of
        another precision is not what this engine's own prefill would give."""
        from mlx.utils import tree_flatten

        floats = {p.dtype for _, p in tree_flatten(self.model.parameters())
                  if mx.issubdtype(p.dtype, mx.floating)}
        widest = max((d.size for d in floats), default=0)
        return "+".join(sorted(str(d).rsplit(".", 1)[-1] for d in floats if d.size == widest))

    def make_caches(self) -> list[Any]:
        """Empty caches for one sequence, in the engine's KV scheme."""
        caches = self.model.make_caches()
        if self.kv_bits is not None:
            from foretell.cache.quantized import quantize_caches

            caches = quantize_caches(caches, self.kv_bits, self.kv_group_size)
        return caches

    def _check_resumable(self) -> None:
        if self.cache is None or self.cache.ssd is None:
            raise GenerationError("resume needs a cache with an SSD tier (--cache-dir)")

    def _request_cache(self, speculator: Speculator | None, resume: bool,
                       settings: dict[str, Any]) -> RequestCache | None:
        if resume:
            self._check_resumable()
        if self.cache is None:
            return None
        from foretell.cache.quantized import kv_scheme
        from foretell.cache.request import RequestCache

        scheme = kv_scheme(self.kv_bits, self.kv_group_size)
        # Entries of one drafter method, KV scheme or compute precision never seed
        # another's requests.
        method = speculator.kind if speculator is not None else "plain"
        namespace = f"{method}/{scheme}/{self.compute_dtype}"
        prefer = None
        if speculator is not None:
            from foretell.spec.attach import draft_settings, preferred_identity

            prefer = preferred_identity(speculator)
            if resume:  # what a speculative run draws depends on the drafter's settings too
                settings = {**settings, "draft": draft_settings(speculator)}
        return RequestCache(self.cache, namespace, resume=resume, settings=settings,
                            prefer=prefer)

    def _open_request(self, ids: list[int], request: RequestCache | None = None) -> RequestState:
        """The request's state, with caches holding as much of the prompt as is known
        (from the prefix cache, or a checkpoint of this very request)."""
        if request is None:
            return RequestState(prompt=ids, caches=self.make_caches(), cached=0)
        caches, cached, tier, replay, keys = request.open(ids, self.make_caches)
        return RequestState(prompt=ids, caches=caches, cached=cached, cached_from=tier,
                            generated=replay, keys=keys, resumed=len(replay))

    def _stats(self, state: RequestState, submitted: float, started: float,
               first_at: float | None) -> Stats:
        ended = time.perf_counter()
        first_at = first_at if first_at is not None else ended
        computed = len(state.prompt) - state.cached
        prompt_time = first_at - started
        decode_time = ended - first_at
        return Stats(
            prompt_tokens=len(state.prompt),
            generated_tokens=state.consumed,
            cached_tokens=state.cached,
            ttft_s=prompt_time,
            queued_s=started - submitted,
            prompt_tps=computed / prompt_time if prompt_time > 0 else 0.0,
            # A resumed request's restored tokens stream out at once: not decode speed.
            generation_tps=(state.consumed - state.resumed) / decode_time
            if decode_time > 0 else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            finish_reason=state.finish_reason or "length",
            cached_from=state.cached_from,
            resumed_tokens=state.resumed,
        )


class _Events:
    """What :meth:`Engine.generate` returns: its request's events, read on the caller's
    thread; an iterator closed or dropped before the end cancels its request, freeing the
    row at the worker's next step."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self._events = iter(handle)
        self._ended = False

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        try:
            return next(self._events)
        except BaseException:  # its end, or its error: the request is over either way
            self._ended = True
            raise

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self.handle.cancel()

    def __del__(self) -> None:
        self.close()


def load(
    model: str | os.PathLike[str] | None = None,
    *,
    registry: Registry | None = None,
    progress: Progress | None = None,
    **engine_options: Any,
) -> Engine:
    """Load a model directory (or a shipped model by name) once, for many requests.

    :param model: a model directory, or the name of a shipped demo model (default "demo").
    :param registry: the plugin registry to find the architecture in; by default plugins
        are discovered and loaded.
    :param progress: called ``(bytes read, bytes total)`` while the weights load.
    :param engine_options: passed to :class:`Engine` (``cache=``, ``kv_bits=``,
        ``settings=``, ...); a field of :class:`~foretell.config.EngineSettings` may be
        given by name (``attention="fused"``, ``cpu_unpack=False``), over ``settings``.
    """
    from foretell.model.loading import load_model
    from foretell.platform import blas

    named = {f.name for f in attrs.fields(EngineSettings)} & set(engine_options)
    settings = attrs.evolve(engine_options.pop("settings", None) or EngineSettings(),
                            **{name: engine_options.pop(name) for name in named})
    blas.warn_if_bound_too_late(mx.default_device() == mx.cpu)
    cuda = device.cuda_backend()
    if cuda is not None:
        cuda.kernels.keep_compiled_kernels()  # before MLX compiles anything
    path = resolve_model_path(model)
    if registry is None:
        from foretell.plugin.loader import load_plugins

        registry = load_plugins().registry
    tokenizer = Tokenizer.from_dir(path)
    # What loading leaves lazy lives on the stream every thread can use.
    with mlx_work(), settings.active():
        model_ = load_model(path, registry, progress=progress)
        if cuda is not None:
            cuda.kernels.precompile(model_)  # started now, waited for by the first request
    return Engine(model_, tokenizer, registry=registry, path=path, settings=settings,
                  **engine_options)
