"""Structured output: a grammar every token of a reply must satisfy, enforced by masking the
model's logits before each draw (the scheduler's :class:`~foretell.scheduler.TokenConstraint`).

Grammars come from llguidance (docs/decisions.md, "Structured output": it compiles a schema
in about a millisecond where outlines-core builds a whole index per schema, and it names
what it cannot enforce). JSON is compact with one space after ``,`` and ``:`` (how
``json.dumps`` writes it, and what models were trained on), without free whitespace: a model
that pads with newlines could otherwise fill ``max_tokens`` with them. A schema llguidance
cannot enforce is refused with its reason, never silently loosened.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from foretell.serve.errors import bad_request

if TYPE_CHECKING:
    import mlx.core as mx

    from foretell.engine import Engine

#: llguidance's JSON compile options (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Grammars for one engine's tokenizer; the tokenizer bridge is built on first use
    (about 0.1 s for a 12k vocabulary) and kept."""

    def __init__(self, engine: Engine) -> None:
        self.vocab = engine.model.vocab_size
        self._tokenizer_json = engine.tokenizer.backend.to_str
        self._eos = sorted(engine.tokenizer.eos_token_ids)
        self._bridge: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._bridge is None:
                import llguidance

                self._bridge = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab, eos_token=self._eos or None)
            return self._bridge

    def json_schema(self, schema: Any, param: str) -> str:
        """The grammar of JSON documents ``schema`` accepts; a 400 naming ``param`` when
        the schema is not one, or asks for what cannot be enforced."""
        import llguidance

        if not isinstance(schema, dict):
            raise bad_request(f"'{param}' must be a JSON Schema object", param=param)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise bad_request(f"'{param}': {exc}", param=param) from None
        self._check(grammar, param)
        return grammar

    def lark(self, source: str, param: str) -> str:
        """A Lark grammar (llguidance's dialect, ``%json {...}`` embeds a schema)."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(source)
        self._check(grammar, param)
        return grammar

    def _check(self, grammar: str, param: str) -> None:
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer())
        if failed:
            raise bad_request(f"'{param}' cannot be enforced: {'; '.join(messages)}",
                              param=param, code="unsupported_schema")

    def constraint(self, grammar: str) -> GrammarConstraint:
        import llguidance

        return GrammarConstraint(llguidance.LLMatcher(self._tokenizer(), grammar), self.vocab)


class GrammarConstraint:
    """One request's grammar state, as the scheduler's token constraint. Called on the
    scheduler's thread only (the masks are MLX arrays made there)."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher = matcher
        self.vocab = vocab

    def allowed(self) -> mx.array:
        import mlx.core as mx
        import numpy as np

        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return mx.array(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(np.bool_))

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    def complete(self) -> bool:
        # An error state (which masking should make impossible) ends the request rather than
        # offering no token at all.
        return self.matcher.is_stopped() or self.matcher.is_error()


def response_format_grammar(grammars: Grammars, value: Any) -> str | None:
    """OpenAI's ``response_format``: ``text`` (None), ``json_object`` or ``json_schema``."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'",
                          param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return grammars.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("'response_format.json_schema' must be an object with a "
                              "'schema' (and a 'name')", param="response_format.json_schema")
        return grammars.json_schema(spec["schema"], "response_format.json_schema.schema")
    raise bad_request(f"'response_format.type' {kind!r} is not one of 'text', 'json_object', "
                      "'json_schema'", param="response_format.type")


def tool_call_grammar(grammars: Grammars, tools: list[dict[str, Any]], open_tag: str,
                      close_tag: str, param: str) -> str:
    """Exactly one call of one of ``tools`` (``{"name", "parameters"}``), in the model's
    own tool-call format: a forced ``tool_choice``."""
    options = [{"type": "object",
                "properties": {"name": {"const": tool["name"]},
                               "arguments": tool.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    source = (f"start: {json.dumps(open_tag + chr(10))} %json {json.dumps(schema)} "
              f"{json.dumps(chr(10) + close_tag)}")
    return grammars.lark(source, param)
