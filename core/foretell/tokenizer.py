"""Text in, token ids out, and back again as a stream that never splits a character.

A model directory carries ``tokenizer.json`` (read by the ``tokenizers`` library),
``tokenizer_config.json`` (bos/eos tokens, ``add_bos_token``, the chat template) and
optionally ``chat_template.jinja``, ``config.json`` and ``generation_config.json`` (more
end-of-sequence ids; ``stop_strings``, the text the model's authors end a completion at).
Every error names the file it came from.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from foretell.detokenizer import (
    RedecodingDetokenizer,
    StreamingDetokenizer,
    compile_decoder,
    token_table,
)
from foretell.errors import ChatTemplateError, TemplateOverflow, TokenizerError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: Files whose ``eos_token_id`` (an int or a list of ints) also ends generation.
EOS_ID_FILES = ("config.json", "generation_config.json")
#: Where a model declares its stop strings (transformers' ``GenerationConfig.stop_strings``).
GENERATION_CONFIG_FILE = "generation_config.json"
#: ``Tokenizer(decoder=...)`` default: read the decoder from the backend itself.
_FROM_BACKEND: Any = object()


# -- reading the model directory -----------------------------------------------------------


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise TokenizerError(f"{path}: missing; a model directory needs this file")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object at the top level")
    return data


def _token_text(value: Any, field: str, path: Path) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f'{path}: {field} must be a string or {{"content": ...}}, got {value!r}')


def _eos_ids_field(data: Mapping[str, Any], path: Path) -> list[int]:
    value = data.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(
            f"{path}: eos_token_id must be a token id or a list of token ids, got {value!r}"
        )
    return list(values)


def _stop_strings_field(data: Mapping[str, Any], path: Path) -> tuple[str, ...]:
    value = data.get("stop_strings")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise TokenizerError(
            f"{path}: stop_strings must be a non-empty string or a list of them, got {value!r}"
        )
    return tuple(values)


def _chat_template(model_dir: Path, config: Mapping[str, Any]) -> tuple[str | None, Path]:
    """The template source and the file it came from; a ``.jinja`` file wins, as in HF."""
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), jinja_file
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_file}: cannot read it: {exc}") from exc
    config_file = model_dir / TOKENIZER_CONFIG_FILE
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template, config_file
    # Some checkpoints ship several named templates; the one named "default" is the chat one.
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen, config_file
        raise TokenizerError(
            f"{config_file}: chat_template lists templates {sorted(map(str, named))} but none "
            "named 'default'"
        )
    raise TokenizerError(
        f"{config_file}: chat_template must be a string, got {type(template).__name__}"
    )


# -- the chat template -----------------------------------------------------------------------

#: A rendered conversation may be this many characters longer than 4x its own text: far
#: beyond any model's context, so only a template that loops or repeats without bound hits
#: it (a downloaded template is untrusted code; the sandbox alone bounds neither).
RENDER_HEADROOM_CHARS = 16 << 20
#: How many times over a template may repeat the conversation's own text.
RENDER_INPUT_FACTOR = 4


def _check_sizes(values: Any, where: str) -> None:
    """Refuse an integer argument beyond the bound: a width or count that would allocate it."""
    for value in values:
        if isinstance(value, int) and abs(value) > RENDER_HEADROOM_CHARS:
            raise TemplateOverflow(f"passes {value} to {where}, more than {RENDER_HEADROOM_CHARS}")


def _check_format_widths(fmt: str, where: str) -> None:
    """Refuse a format string whose width or precision is beyond the bound
    (``'%10000000000d'``, ``'{:>10000000000}'``)."""
    specs = re.findall(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?", fmt)
    specs += [(n,) for spec in re.findall(r"\{[^{}]*?:([^{}]*)\}", fmt)
              for n in re.findall(r"\d+", spec)]
    _check_sizes([int(n) for group in specs for n in group if n], where)


def _bounded_sandbox(**options: Any) -> Any:
    """An immutable Jinja sandbox whose one-step blow-ups are refused before they allocate:
    ``'x' * 10**10``, ``10 ** 10**10``, ``'x'.ljust(10**10)``, ``'x'|center(10**10)``,
    ``'%10000000000d' % 1`` (loops are bounded by counting the render's output instead)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if (isinstance(seq, (str, list, tuple)) and isinstance(times, int)
                            and len(seq) * times > RENDER_HEADROOM_CHARS):
                        raise TemplateOverflow(
                            f"repeats a sequence of {len(seq)} x {times}, more than "
                            f"{RENDER_HEADROOM_CHARS} elements")
            elif operator == "**":
                if (isinstance(left, int) and isinstance(right, int) and right > 0
                        and abs(left) > 1 and right * abs(left).bit_length() > 1 << 16):
                    raise TemplateOverflow(f"computes {left} ** {right}, a number of more "
                                            f"than {1 << 16} bits")
            elif isinstance(left, str):
                _check_format_widths(left, "'%'")
                _check_sizes(right if isinstance(right, tuple) else (right,), "'%'")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _check_sizes((*args, *kwargs.values()), getattr(__obj, "__name__", repr(__obj)))
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Any:
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format_widths(value.__self__, f"str.{value.__name__}")
            return wrapped

    env = BoundedSandbox(**options)
    # Filters are called directly by compiled templates, not through ``call``.
    for name, fn in list(env.filters.items()):
        env.filters[name] = _size_checked_filter(name, fn)
    return env


def _size_checked_filter(name: str, fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marker
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_sizes((*args, *kwargs.values()), f"the {name} filter")
        if name == "format" and args and isinstance(args[0], str):
            _check_format_widths(args[0], "the format filter")
        return fn(*args, **kwargs)

    return checked


class ChatTemplate:
    """A Hugging Face chat template, rendered in a sandbox the way transformers renders it."""

    def __init__(self, source: str, origin: Path, variables: Mapping[str, Any]):
        import jinja2

        self.origin = origin
        self._variables = dict(variables)
        env = _bounded_sandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _size_checked_filter("tojson", _tojson)
        env.globals["raise_exception"] = self._raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"{origin}: the chat template does not parse (template line {exc.lineno}): "
                f"{exc.message}"
            ) from exc

    def _raise(self, message: str) -> None:
        raise ChatTemplateError(
            f"{self.origin}: the chat template refused the conversation: {message}"
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        import jinja2

        messages = list(messages)
        own_text = len(json.dumps([messages, extra], default=str, ensure_ascii=False))
        limit = RENDER_HEADROOM_CHARS + RENDER_INPUT_FACTOR * own_text
        pieces: list[str] = []
        size = 0
        try:
            # Streamed piece by piece so a looping template is stopped at the bound, not
            # when memory runs out.
            for piece in self._template.generate(
                **self._variables,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **extra,
            ):
                size += len(piece)
                if size > limit:
                    raise TemplateOverflow(
                        f"produced more than {limit} characters ({RENDER_HEADROOM_CHARS} plus "
                        f"{RENDER_INPUT_FACTOR}x the conversation's {own_text})"
                    )
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except TemplateOverflow as exc:
            raise ChatTemplateError(
                f"{self.origin}: the chat template {exc}: it is broken or hostile; fix or "
                "replace the template"
            ) from None
        except RecursionError:
            raise ChatTemplateError(
                f"{self.origin}: the chat template recurses without end (a macro that calls "
                "itself?)"
            ) from None
        except MemoryError:
            raise ChatTemplateError(
                f"{self.origin}: the chat template ran out of memory while rendering"
            ) from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"{self.origin}: rendering the chat template failed: {exc}"
            ) from exc
        return "".join(pieces)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes; chat templates expect plain JSON (as transformers does).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# -- the tokenizer -----------------------------------------------------------------------------


class Tokenizer:
    """A model directory's tokenizer: encode, decode, stream, and render chat templates."""

    def __init__(
        self,
        backend: Any,
        *,
        source: Path,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        chat_template: ChatTemplate | None = None,
        decoder: Any = _FROM_BACKEND,
    ):
        self.backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self._add_bos_token = add_bos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        #: Text the model's generation_config.json ends completions at (``stop_strings``).
        #: The CLI applies them; the Python API, like mlx-lm's, only when passed as ``stop``.
        self.stop_strings = tuple(stop_strings)
        self.chat_template = chat_template
        self._decoder = decoder
        self._streaming: tuple[Any, list[str | None]] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Read the tokenizer of a model directory; errors name the file that is wrong."""
        from tokenizers import Tokenizer as Backend

        model_dir = Path(model_dir)
        tokenizer_file = model_dir / TOKENIZER_FILE
        raw = _read_json(tokenizer_file, required=True)
        try:
            backend = Backend.from_str(json.dumps(raw))
        except Exception as exc:  # the Rust side raises its own exception type
            raise TokenizerError(
                f"{tokenizer_file}: the tokenizers library rejects it: {exc}"
            ) from exc

        config_file = model_dir / TOKENIZER_CONFIG_FILE
        config = _read_json(config_file, required=False)
        bos = _token_text(config.get("bos_token"), "bos_token", config_file)
        eos = _token_text(config.get("eos_token"), "eos_token", config_file)
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerError(
                f"{config_file}: add_bos_token must be true or false, got {add_bos!r}"
            )

        eos_ids: list[int] = []
        for name, value in (("bos_token", bos), ("eos_token", eos)):
            if value is not None and backend.token_to_id(value) is None:
                raise TokenizerError(
                    f"{config_file}: {name} {value!r} is not in {TOKENIZER_FILE}'s vocabulary"
                )
        if eos is not None:
            eos_ids.append(backend.token_to_id(eos))
        for name in EOS_ID_FILES:
            path = model_dir / name
            eos_ids += _eos_ids_field(_read_json(path, required=False), path)
        generation_file = model_dir / GENERATION_CONFIG_FILE
        stops = _stop_strings_field(_read_json(generation_file, required=False), generation_file)

        source, origin = _chat_template(model_dir, config)
        template = None
        if source is not None:
            variables = {
                "bos_token": bos or "",
                "eos_token": eos or "",
                "pad_token": _token_text(config.get("pad_token"), "pad_token", config_file) or "",
                "unk_token": _token_text(config.get("unk_token"), "unk_token", config_file) or "",
            }
            template = ChatTemplate(source, origin, variables)

        return cls(
            backend,
            source=model_dir,
            bos_token=bos,
            eos_token=eos,
            add_bos_token=add_bos,
            eos_token_ids=eos_ids,
            stop_strings=stops,
            chat_template=template,
            decoder=raw.get("decoder"),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor adds BOS
        (and ``add_bos_token`` from tokenizer_config.json is enforced either way)."""
        # encode_batch releases the interpreter while it works (encode holds it: a server's
        # worker thread could build no step while a long prompt was tokenized); same ids.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None or self._add_bos_token is None:
            return ids
        if self._add_bos_token and (not ids or ids[0] != bos):
            return [bos, *ids]
        if (
            not self._add_bos_token
            and ids
            and ids[0] == bos
            and not text.startswith(self.bos_token)
        ):
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The conversation rendered as the model was trained to see it."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.source}: no chat template ({TOKENIZER_CONFIG_FILE} has no chat_template "
                f"and there is no {CHAT_TEMPLATE_FILE}); pass the prompt as plain text"
            )
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )

    def detokenizer(self) -> StreamingDetokenizer | RedecodingDetokenizer:
        """A fresh streaming detokenizer for one sequence; its text equals :meth:`decode`."""
        if self._streaming is None:
            # Built once per tokenizer, on first use, not at load: it is costly for a large
            # vocabulary (docs/decisions.md).
            decoder = self._decoder
            if decoder is _FROM_BACKEND:
                decoder = json.loads(self.backend.to_str()).get("decoder")
            vocab = self.backend.get_vocab(with_added_tokens=True)
            self._streaming = (compile_decoder(decoder), token_table(vocab.items()))
        chain, tokens = self._streaming
        if chain is None:
            return RedecodingDetokenizer(self.decode)
        return StreamingDetokenizer(tokens, chain)
