"""Typed configuration: frozen attrs classes, one private cattrs converter, pinned errors.

A run configuration comes from a TOML file and is overridden by CLI flags; both go through
the same structuring, so a bad value reads the same wherever it came from, e.g.
``run.toml: draft.num_tokens: must be >= 1, got 0``. Polymorphic sections
(``[draft] kind = "two-model"``) resolve ``kind`` through the plugin registry and structure
the rest of the section into that contribution's own config class.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
import cattrs.gen
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from foretell.errors import ConfigError, ForetellError
from foretell.plugin.registry import Kind, Registry

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


class FieldError(ValueError):
    """A field's value is out of range; the message is what is wrong, the path is added."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


class WrongType(TypeError):
    """A value of the wrong type, e.g. a string where an integer belongs."""


# -- validators whose messages name what is wrong ----------------------------------------


def at_least(lo: float):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value < lo:
            raise FieldError(attribute.name, f"must be >= {lo}, got {value!r}")

    return check


def whole_number(lo: int = 1):
    """A validator for plugin configs: an int (not a bool) of at least ``lo``."""

    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise FieldError(attribute.name, f"must be a whole number >= {lo}, got {value!r}")

    return check


def number(lo: float = 0):
    """A validator for plugin configs: an int or float (not a bool) of at least ``lo``."""

    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
            raise FieldError(attribute.name, f"must be a number >= {lo}, got {value!r}")

    return check


def greater_than(lo: float):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value <= lo:
            raise FieldError(attribute.name, f"must be > {lo}, got {value!r}")

    return check


def less_than(hi: float):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value >= hi:
            raise FieldError(attribute.name, f"must be < {hi}, got {value!r}")

    return check


def at_most(hi: float):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value > hi:
            raise FieldError(attribute.name, f"must be <= {hi}, got {value!r}")

    return check


# -- the run configuration ---------------------------------------------------------------


#: Token counts index MLX arrays, whose indices are 32-bit: a larger one fails deep in MLX.
INT32_MAX = 2**31 - 1


@attrs.frozen(kw_only=True)
class SamplingConfig:
    """How the next token is chosen. ``temp = 0`` is greedy (argmax)."""

    temp: float = attrs.field(default=0.0, validator=at_least(0.0), metadata={"help": "sampling temperature; 0 is greedy"})
    top_p: float = attrs.field(default=1.0, validator=[greater_than(0.0), at_most(1.0)], metadata={"help": "nucleus sampling mass; 1 disables"})
    top_k: int = attrs.field(default=0, validator=[at_least(0), at_most(INT32_MAX)], metadata={"help": "keep the k most likely tokens; 0 disables"})
    min_p: float = attrs.field(default=0.0, validator=[at_least(0.0), at_most(1.0)], metadata={"help": "drop tokens below min_p x the top probability; 0 disables"})
    repetition_penalty: float = attrs.field(default=1.0, validator=greater_than(0.0), metadata={"help": "divide logits of recent tokens by this; 1 disables"})
    repetition_context_size: int = attrs.field(default=20, validator=[at_least(1), at_most(INT32_MAX)], metadata={"help": "how many recent tokens the penalty sees"})
    # MLX's PRNG key is an unsigned 64-bit integer.
    seed: int | None = attrs.field(default=None, validator=[at_least(0), less_than(2**64)], metadata={"help": "random seed, 0 <= seed < 2**64; the same seed reproduces a plain run (a sampled speculative one only with a fixed draft length: docs/speculation.md)"})


#: ``[draft] kind`` values that name no provider: speculation off, or the model's measured best.
DRAFT_NONE, DRAFT_AUTO = "none", "auto"
#: The most tokens drafted per round when neither ``[draft] num_tokens``, the model's
#: ``speculation.json`` nor the drafter itself (``draft_tokens``) says (mlx-lm's
#: ``--num-draft-tokens`` default is 3).
DEFAULT_DRAFT_TOKENS = 4
#: The most tokens any round may draft, however it is set (a verify window is the pending
#: token and at most this many drafts: ``foretell.model.fixed.MAX_TOKENS``).
MAX_DRAFT_TOKENS = 16
#: The storage layout the SSD tier uses unless ``[cache] layout`` names another.
DEFAULT_LAYOUT = "blocks"


@attrs.frozen(kw_only=True)
class DraftSettings:
    """The ``[draft]`` fields every drafter shares (the rest are the provider's own)."""

    num_tokens: int | None = attrs.field(default=None, validator=[at_least(1), at_most(MAX_DRAFT_TOKENS)], metadata={"help": f"the most tokens drafted per round (--num-draft-tokens); unset: the model's measured best where speculation.json gives one, else the drafter's own, else {DEFAULT_DRAFT_TOKENS}"})
    adaptive: bool = attrs.field(default=True, metadata={"help": "choose the draft length per round from measured acceptance and cost"})
    acceptance: str = attrs.field(default="rejection", metadata={"help": "sampled verification: 'rejection' (exact, accepts more) or 'token-match' (mlx-lm's rule)"})

    @acceptance.validator
    def _acceptance(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in ("rejection", "token-match"):
            raise FieldError(attribute.name, f"must be 'rejection' or 'token-match', got {value!r}")


@attrs.frozen(kw_only=True)
class DraftSection:
    """``[draft]``: which draft provider speculative decoding uses, and its own options.

    ``kind = "none"`` turns speculation off; ``"auto"`` (the default) uses the drafter
    measured best for the model on this kind of machine, where one is known.
    """

    kind: str
    settings: DraftSettings = attrs.Factory(DraftSettings)
    options: Any = None  # an instance of the provider's registered config class


def _kv_bits(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value not in (4, 8):
        raise FieldError(attribute.name, f"must be 4 or 8, got {value!r}")


def _a_directory(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    # A missing directory is created on first use; an unwritable one warns and generation
    # goes on (a full disk never stops it). A path that names a file is a mistake to refuse.
    # A URL (redis://...) is its layout's to check: the layout registered for its scheme.
    if value is not None and not str(value).strip():  # an unset shell variable, most likely
        raise FieldError(attribute.name, "is empty: give a directory, or leave it out for "
                                         "no persistent cache")
    from foretell.store.layout import url_scheme

    if url_scheme(value) is not None:
        return
    path = Path(value).expanduser() if value is not None else None
    if path is not None and path.exists() and not path.is_dir():
        raise FieldError(attribute.name, f"{value} is a file, not a directory")


@attrs.frozen(kw_only=True)
class CacheSection:
    """``[cache]``: the prefix cache tier (docs/cache-storage.md)."""

    dir: str | None = attrs.field(default=None, validator=_a_directory, metadata={"help": "cache directory (the SSD tier), or a URL a storage layout serves (redis://HOST:PORT/DB with foretell-redis, which then is the layout); unset: no persistent cache"})
    max_gb: float = attrs.field(default=32.0, validator=at_least(0.0), metadata={"help": "byte cap of the SSD tier, GiB, per model and KV scheme in the directory"})
    ram_gb: float = attrs.field(default=4.0, validator=at_least(0.0), metadata={"help": "byte cap of the RAM prefix cache, GiB"})
    layout: str = attrs.field(default=DEFAULT_LAYOUT, metadata={"help": "storage layout of the SSD tier (see `foretell plugins`); `blocks` shares blocks between entries (docs/block-store.md); a URL `dir` selects the layout registered for its scheme"})
    kv_bits: int | None = attrs.field(default=None, validator=_kv_bits, metadata={"help": "quantize full-attention KV to 4 or 8 bits"})
    resume: bool = attrs.field(default=False, metadata={"help": "checkpoint the generation and continue an interrupted identical one (`foretell run`; `foretell chat` ignores it)"})
    checkpoint_every: int = attrs.field(default=64, validator=at_least(1), metadata={"help": "tokens between generation checkpoints"})
    #: The layout's own options (its registered config class), read from the same
    #: ``[cache]`` table as the keys above; None: the layout's defaults.
    layout_options: Any = attrs.field(default=None, metadata={"internal": True})


def _a_host(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value.strip() or value != value.strip():
        raise FieldError(attribute.name, f"must be an address or host name without spaces, "
                                         f"got {value!r}")


def _a_model_name(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not value.strip() or value != value.strip()):
        raise FieldError(attribute.name, f"must be a name without surrounding spaces, got {value!r}")


def api_key_problem(key: str) -> str | None:
    """What is wrong with ``key`` as an API key, or None. Never quotes the key (a secret)."""
    if not key or key != key.strip() or not (key.isascii() and key.isprintable()):
        return ("must be printable ASCII, not empty, without surrounding spaces (clients "
                "send it in an HTTP header)")
    return None


def _an_api_key(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (problem := api_key_problem(value)) is not None:
        raise FieldError(attribute.name, problem)


def _an_env_name(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) is None:
        raise FieldError(attribute.name, f"must name an environment variable (letters, digits "
                                         f"and _, without '$'), got {value!r}")


@attrs.frozen(kw_only=True)
class ServeSection:
    """``[serve]``: where ``foretell serve`` listens, who may call it and how much it takes
    at once (docs/serve.md); ``run`` and ``chat`` ignore it. Each key is also a flag."""

    host: str = attrs.field(default="127.0.0.1", validator=_a_host, metadata={"help": "the address to listen on (--host); 0.0.0.0 opens it to the network"})
    port: int = attrs.field(default=8080, validator=[at_least(0), at_most(65535)], metadata={"help": "the port (--port); 0 picks a free one"})
    api_key: str | None = attrs.field(default=None, validator=_an_api_key, metadata={"help": "every /v1 request must carry this key (--api-key); $FORETELL_API_KEY or --api-key replaces it (and api_key_env); unset: no key needed"})
    api_key_env: str | None = attrs.field(default=None, validator=_an_env_name, metadata={"help": "instead of api_key: the environment variable holding the key, read at start (the file then holds no secret); unset or empty at start is an error, never a server without a key"})
    served_model_name: str | None = attrs.field(default=None, validator=_a_model_name, metadata={"help": "the model id clients send and /v1/models lists (--served-model-name); unset: the model directory's name"})
    max_rows: int = attrs.field(default=32, validator=[at_least(1), at_most(INT32_MAX)], metadata={"help": "the most requests decoding together (--max-rows)"})
    max_waiting: int = attrs.field(default=256, validator=[at_least(0), at_most(INT32_MAX)], metadata={"help": "requests that may wait for a row (--max-waiting); beyond, a 429 with Retry-After"})
    kv_budget_gb: float | None = attrs.field(default=None, validator=greater_than(0.0), metadata={"help": "KV cache the running requests may hold, GiB (--kv-budget-gb); unset: 40% of the device's memory"})
    access_log: bool = attrs.field(default=True, metadata={"help": "log each HTTP request (--access-log / --no-access-log)"})
    warm_shapes: bool = attrs.field(default=True, metadata={"help": "where the device compiles kernels per shape (MLX-CUDA), decode 1..max_rows requests at once before listening, so no burst waits on a compile (--warm-shapes / --no-warm-shapes)"})

    def __attrs_post_init__(self) -> None:
        if self.api_key is not None and self.api_key_env is not None:
            raise FieldError("api_key_env", "give the key or the variable holding it, not both "
                                            "(api_key is also set)")


@attrs.frozen(kw_only=True)
class RunConfig:
    """What ``foretell run`` does (``chat`` and ``serve`` too); every field is also a CLI
    flag."""

    model: str | None = attrs.field(default=None, metadata={"help": "model directory or shipped model name"})
    max_tokens: int = attrs.field(default=256, validator=at_least(1), metadata={"help": "most tokens to generate"})
    chat: bool = attrs.field(default=False, metadata={"help": "apply the model's chat template to the prompt (`foretell chat` always does)"})
    sampling: SamplingConfig = attrs.Factory(SamplingConfig)
    draft: DraftSection | None = None
    cache: CacheSection = attrs.Factory(CacheSection)
    serve: ServeSection = attrs.Factory(ServeSection)


# -- one engine's path choices ----------------------------------------------------------


def _one_of(*choices: str):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"engine setting {attribute.name!r}",
                              [f"{value!r} is not one of {', '.join(choices)}"])

    return check


def _a_flag(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"engine setting {attribute.name!r}",
                          [f"{value!r} is not True, False or None"])


def _duty(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= 1):
        raise ConfigError(f"engine setting {attribute.name!r}",
                          [f"{value!r} is not a number in (0, 1]"])


@attrs.frozen(kw_only=True)
class EngineSettings:
    """Path choices one engine makes, so two engines in one process may differ
    (``foretell.load(path, attention="fused")``). ``"auto"`` / None leaves the choice to
    the operator's environment variable where it is set, else to the device
    (docs/environment.md). They apply to what runs for the engine: its load, its requests,
    its drafter's load and warm-up, and the cache tier it opens from a directory."""

    attention: str = attrs.field(default="auto", validator=_one_of("auto", "fused", "matmul", "matmul-float32", "matmul-all"), metadata={"help": "attention of a few-token query by matmuls or by MLX's fused kernel (FORETELL_ATTENTION)"})
    fixed_shapes: str = attrs.field(default="auto", validator=_one_of("auto", "on", "off"), metadata={"help": "verify windows run compiled forwards of fixed shapes (FORETELL_FIXED_SHAPES)"})
    sliding_window: str = attrs.field(default="auto", validator=_one_of("auto", "copy", "view"), metadata={"help": "a sliding-window cache past its window hands attention a copy or a view (FORETELL_SLIDING_WINDOW)"})
    quantized_products: str = attrs.field(default="auto", validator=_one_of("auto", "quantized", "dequantized"), metadata={"help": "attention over quantized KV calls quantized matmuls or dequantizes (FORETELL_QUANTIZED_PRODUCTS)"})
    cpu_unpack: bool | None = attrs.field(default=None, validator=_a_flag, metadata={"help": "quantized weights run unpacked to float32 on the CPU (FORETELL_CPU_UNPACK)"})
    cpu_transpose: bool | None = attrs.field(default=None, validator=_a_flag, metadata={"help": "float32 weights kept input-major on the CPU, where OpenBLAS multiplies them faster (FORETELL_CPU_TRANSPOSE)"})
    spill_duty: float | None = attrs.field(default=None, validator=_duty, metadata={"help": "the share of its time the spill worker may write (FORETELL_SPILL_DUTY)"})

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """These settings decide for the work run inside (on this thread, in this context)."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


_ACTIVE: contextvars.ContextVar[EngineSettings | None] = contextvars.ContextVar(
    "foretell_engine_settings", default=None)


def engine_choice(name: str) -> Any:
    """The choice of the engine whose work runs now for setting ``name``, or None where the
    process default decides (``"auto"``, None, or no engine's work running)."""
    settings = _ACTIVE.get()
    value = None if settings is None else getattr(settings, name)
    return None if value == "auto" else value


# -- the converter -------------------------------------------------------------------------


def make_converter(registry: Registry) -> cattrs.Converter:
    """The one converter, built after plugins load so polymorphic sections see them all."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

    def strict_int(value: Any, _t: type) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WrongType(f"expected an integer, got {value!r}")
        return value

    def strict_float(value: Any, _t: type) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WrongType(f"expected a number, got {value!r}")
        # nan passes every range check (each comparison is False) and inf makes garbage.
        if not math.isfinite(value):
            raise WrongType(f"expected a finite number, got {value!r}")
        return float(value)

    def strict_str(value: Any, _t: type) -> str:
        if not isinstance(value, str):
            raise WrongType(f"expected a string, got {value!r}")
        return value

    def strict_bool(value: Any, _t: type) -> bool:
        if not isinstance(value, bool):
            raise WrongType(f"expected true or false, got {value!r}")
        return value

    conv.register_structure_hook(int, strict_int)
    conv.register_structure_hook(float, strict_float)
    conv.register_structure_hook(str, strict_str)
    conv.register_structure_hook(bool, strict_bool)

    # A section given as a scalar (`sampling = 3`) must say so, not surface the generated
    # code's "argument of type 'int' is not iterable". Registered first so the
    # hand-written section hooks below take precedence.
    def table_of(cls: type) -> Any:
        fields_fn = cattrs.gen.make_dict_structure_fn(cls, conv)

        def structure_table(body: Any, _t: type) -> Any:
            if not isinstance(body, Mapping):
                raise WrongType(f"expected a table, got {body!r}")
            return fields_fn(body, _t)

        return structure_table

    conv.register_structure_hook_factory(attrs.has, table_of)

    # A predicate, not a class hook: class hooks also catch subclasses, and plugin config
    # classes structured inside would loop back here (reference/plugin-anchors.md §6.4).
    def structure_draft(body: Any, _t: type) -> DraftSection:
        if not isinstance(body, Mapping):
            raise WrongType(f"expected a table with a 'kind' key, got {body!r}")
        shared = {a.name for a in attrs.fields(DraftSettings)}
        settings = conv.structure({k: v for k, v in body.items() if k in shared}, DraftSettings)
        rest = {k: v for k, v in body.items() if k not in shared}
        if rest.get("kind") in (DRAFT_NONE, DRAFT_AUTO):
            extra = sorted(set(rest) - {"kind"})
            if extra:
                raise FieldError(extra[0], f"unknown field: draft kind '{rest['kind']}' takes no options")
            given = sorted(shared & set(body))
            if rest["kind"] == DRAFT_NONE and given:  # else ignored in silence
                raise FieldError(given[0], "draft kind 'none' turns speculation off: no draft "
                                 "setting applies")
            return DraftSection(kind=rest["kind"], settings=settings)
        name, options = _structure_selected(conv, registry, Kind.DRAFT, rest)
        return DraftSection(kind=name, settings=settings, options=options)

    conv.register_structure_hook_func(lambda t: t is DraftSection, structure_draft)

    own_cache_keys = {a.name for a in attrs.fields(CacheSection)} - {"layout_options"}
    structure_cache_keys = cattrs.gen.make_dict_structure_fn(
        CacheSection, conv, _cattrs_forbid_extra_keys=True)

    def structure_cache(body: Any, _t: type) -> CacheSection:
        """``[cache]``: the tier's keys, then the chosen layout's own options (flattened
        into the same table, as a drafter's are into ``[draft]``)."""
        if not isinstance(body, Mapping):
            raise WrongType(f"expected a table, got {body!r}")
        section = structure_cache_keys({k: v for k, v in body.items() if k in own_cache_keys},
                                       CacheSection)
        serving = _layout_at(registry, section.dir)
        if serving is not None:  # a URL decides its layout; naming another is a mistake
            if "layout" in body and section.layout != serving.name:
                raise FieldError("layout", f"'{section.layout}' does not store at "
                                           f"{section.dir}: layout '{serving.name}' does")
            section = attrs.evolve(section, layout=serving.name)
        rest = {k: v for k, v in body.items() if k not in own_cache_keys}
        if not rest:
            return section
        try:
            contribution = registry.get(Kind.LAYOUT, section.layout)
        except ForetellError as exc:
            raise FieldError("layout", str(exc)) from exc
        layout_keys = ({a.name for a in attrs.fields(contribution.config)}
                       if contribution.config is not None else set())
        for key in sorted(rest):
            if key not in layout_keys:
                known = ", ".join(sorted(own_cache_keys | layout_keys))
                raise FieldError(key, f"unknown field (known here, with layout "
                                      f"'{section.layout}': {known})")
        return attrs.evolve(section, layout_options=conv.structure(rest, contribution.config))

    conv.register_structure_hook_func(lambda t: t is CacheSection, structure_cache)
    conv.register_unstructure_hook(
        DraftSection,
        lambda d: {"kind": d.kind, **conv.unstructure(d.settings),
                   **(conv.unstructure(d.options) if d.options is not None else {})},
    )
    return conv


def _layout_at(registry: Registry, location: str | None) -> Any:
    """The layout registered for ``location``'s URL scheme (None for a directory).

    :raises FieldError: ``dir``: a URL no installed layout serves."""
    try:
        return registry.layout_for(location)
    except ForetellError as exc:
        raise FieldError("dir", str(exc)) from exc


def _structure_selected(
    conv: cattrs.Converter, registry: Registry, kind: Kind, body: Any
) -> tuple[str, Any]:
    if not isinstance(body, Mapping):
        raise WrongType(f"expected a table with a 'kind' key, got {body!r}")
    if "kind" not in body:
        options = ", ".join(sorted(body))
        raise FieldError("kind", f"required: one of {', '.join(registry.names(kind)) or 'none installed'}"
                                 + (f", to take the options given ({options})" if options else ""))
    name = body["kind"]
    if not isinstance(name, str):
        raise FieldError("kind", f"expected a string, got {name!r}")
    try:
        contribution = registry.get(kind, name)
    except ForetellError as exc:
        raise FieldError("kind", str(exc)) from exc
    rest = {k: v for k, v in body.items() if k != "kind"}
    if contribution.config is None or not attrs.fields(contribution.config):
        if rest:
            raise FieldError(sorted(rest)[0], f"unknown field: {kind.value} '{name}' takes no options")
        return name, None if contribution.config is None else contribution.config()
    return name, conv.structure(rest, contribution.config)


# -- loading and error rendering ---------------------------------------------------------


def structure(conv: cattrs.Converter, data: Mapping[str, Any], cls: type, source: str) -> Any:
    """Structure ``data`` into ``cls``; any problem becomes a ConfigError naming ``source``."""
    try:
        return conv.structure(dict(data), cls)
    except Exception as exc:  # cattrs raises groups, validators raise FieldError
        lines = list(error_lines(exc, ""))
        if not lines:
            raise
        raise ConfigError(source, lines) from exc


def error_lines(exc: BaseException, path: str) -> Iterator[str]:
    """``field.path: what is wrong`` for every leaf problem inside ``exc``."""
    if isinstance(exc, BaseValidationError):
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    sub_path = _join(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_path = f"{path}[{note.index!r}]"
            yield from error_lines(sub, sub_path)
    elif isinstance(exc, FieldError):
        yield f"{_join(path, exc.field)}: {exc.message}"
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = sorted(a.name for a in attrs.fields(exc.cl)) if attrs.has(exc.cl) else []
        listing = f"known: {', '.join(known)}" if known else "this section takes no options"
        for key in sorted(exc.extra_fields):
            yield f"{_join(path, key)}: unknown field ({listing})"
    elif isinstance(exc, KeyError):
        yield f"{path}: required field missing"
    elif isinstance(exc, (WrongType, TypeError, ValueError)):
        yield f"{path or '<top>'}: {exc}"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8 by definition
        raise ConfigError(str(path), [f"not UTF-8 text (byte {exc.start}: "
                                      f"{exc.object[exc.start:exc.start + 1]!r}); TOML files "
                                      "are UTF-8"]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [f"invalid TOML: {exc}"]) from exc


def _draft_table_for(table: dict[str, Any], kind: str) -> dict[str, Any]:
    """A config file's ``[draft]`` table once a flag chose draft kind ``kind``: another
    kind's own options belong to that drafter and go (else `--draft none` over a file that
    configures a drafter could not turn it off); with ``none``, the shared settings too."""
    if table.get("kind") == kind:
        return table
    if kind == DRAFT_NONE:
        return {}
    shared = {a.name for a in attrs.fields(DraftSettings)}
    return {key: value for key, value in table.items() if key in shared}


def load_run_config(
    registry: Registry,
    path: str | Path | None = None,
    overrides: Mapping[str, tuple[Any, str]] | None = None,
) -> RunConfig:
    """The run configuration from an optional TOML file plus CLI overrides.

    :param overrides: ``{"sampling.temp": (0.7, "--temp")}``; values of ``None`` are skipped.
        An error caused by an override names the flag.
    """
    data = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "command line"
    kind = (overrides or {}).get("draft.kind", (None, ""))[0]
    if kind is not None and isinstance(data.get("draft"), dict):
        data["draft"] = _draft_table_for(data["draft"], kind)
    if ((overrides or {}).get("serve.api_key", (None, ""))[0] is not None
            and isinstance(data.get("serve"), dict)):
        data["serve"].pop("api_key_env", None)  # a key given at start replaces the file's
    flags: dict[str, str] = {}
    for dotted, (value, flag) in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        flags[dotted] = flag
    try:
        return structure(make_converter(registry), data, RunConfig, source)
    except ConfigError as exc:
        if not flags:
            raise
        lines = []
        for line in exc.lines:
            field = line.split(":", 1)[0]
            lines.append(f"{line} (set by {flags[field]})" if field in flags else line)
        raise ConfigError(source, lines) from exc.__cause__
