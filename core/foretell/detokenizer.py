"""Streaming detokenization: token ids to text, one id at a time, equal to decoding them all.

Most ``tokenizers`` decoder chains are per-token maps up to the point where the tokens fuse
into one string (``Fuse``, ``ByteLevel``, the final join), so they can run incrementally:
:func:`compile_decoder` turns a ``tokenizer.json``'s ``decoder`` into such a stream,
reproducing the library's rules exactly (a ``ByteFallback`` run of ``<0xNN>`` tokens is held
until it ends; ``Metaspace`` prepending ``always``/``first`` drops every ``▁`` of the first
token; no decoder joins with spaces). A chain with a step it cannot stream returns None, and
:class:`RedecodingDetokenizer` re-decodes the whole sequence instead (quadratic, exact
whenever decoding a prefix of the ids gives a prefix of the text).
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

_HEX_BYTE = re.compile(r"\+?[0-9A-Fa-f]{1,2}")
_WORDPIECE_CLEANUP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte is a printable character; this inverts it."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


@functools.lru_cache(maxsize=1 << 16)
def _byte_level_bytes(token: str) -> bytes:
    # Cached: every row of a batch decodes each token through here, and building the bytes
    # costs several times the lookup.
    alphabet = _byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:  # a token with a character outside the alphabet: its text as is
        return token.encode("utf-8")


def _fallback_byte(token: str) -> int | None:
    """The byte a ``<0xNN>`` token stands for (the library's test: 6 bytes, hex inside)."""
    if len(token.encode("utf-8")) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if _HEX_BYTE.fullmatch(digits):
            return int(digits, 16)
    return None


# -- the stages of a compiled chain -----------------------------------------------------------
#
# Before the fuse point a stage maps a list of tokens to a list of tokens (most map one to
# one); after it, there is a single string arriving in chunks.


class _Map:
    """A per-token step; ``fn(token, first)`` knows whether the token is its first."""

    def __init__(self, fn: Callable[[str, bool], str]):
        self._fn = fn
        self._first = True

    def push(self, tokens: list[str]) -> list[str]:
        out = []
        for token in tokens:
            out.append(self._fn(token, self._first))
            self._first = False
        return out

    def finish(self) -> list[str]:
        return []


class _ByteFallback:
    def __init__(self) -> None:
        self._run = bytearray()

    def push(self, tokens: list[str]) -> list[str]:
        out = []
        for token in tokens:
            byte = _fallback_byte(token)
            if byte is not None:
                self._run.append(byte)
                continue
            out += self.finish()
            out.append(token)
        return out

    def finish(self) -> list[str]:
        if not self._run:
            return []
        run, self._run = bytes(self._run), bytearray()
        try:
            return [run.decode("utf-8")]
        except UnicodeDecodeError:
            return ["\ufffd"] * len(run)


class _Join:
    """The fuse point for chains that concatenate: ``Fuse`` or the final join."""

    def push(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def push_one(self, token: str) -> str:
        return token

    def finish(self) -> str:
        return ""


class _ByteLevel:
    """The fuse point of byte-level BPE: all tokens' bytes, decoded as one lossy string."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens: list[str]) -> str:
        return self._utf8.decode(b"".join(_byte_level_bytes(t) for t in tokens))

    def push_one(self, token: str) -> str:
        return self._utf8.decode(_byte_level_bytes(token))

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


class _StripLeading:
    """``Strip(content, start, 0)`` on the fused string: drop up to ``start`` leading
    ``content`` characters."""

    def __init__(self, content: str, start: int):
        self._content = content
        self._left = start

    def push(self, text: str) -> str:
        while self._left and text:
            if text[0] != self._content:
                self._left = 0
                break
            text, self._left = text[1:], self._left - 1
        return text

    def finish(self) -> str:
        return ""


class _ChunkMap:
    """A character-local step on the fused string (a one-character ``Replace``)."""

    def __init__(self, fn: Callable[[str], str]):
        self._fn = fn

    def push(self, text: str) -> str:
        return self._fn(text)

    def finish(self) -> str:
        return ""


# -- compiling a tokenizer.json decoder ---------------------------------------------------


def _flatten(decoder: Any) -> list[Any] | None:
    if not isinstance(decoder, Mapping):
        return None
    if decoder.get("type") != "Sequence":
        return [decoder]
    steps: list[Any] = []
    for part in decoder.get("decoders") or []:
        flat = _flatten(part)
        if flat is None:
            return None
        steps += flat
    return steps


def _strip(content: str, start: int, stop: int) -> Callable[[str, bool], str]:
    def strip(token: str, first: bool) -> str:
        chars = list(token)
        begin = 0
        for i, c in enumerate(chars[:start]):
            if c != content:
                break
            begin = i + 1
        end = len(chars)
        for i in range(min(stop, len(chars))):
            if chars[len(chars) - i - 1] != content:
                break
            end = len(chars) - i - 1
        return "".join(chars[begin:max(begin, end)])

    return strip


def _metaspace(step: Mapping[str, Any]) -> tuple[str, bool]:
    replacement = step.get("replacement", "▁")
    scheme = step.get("prepend_scheme")
    if scheme is None:
        scheme = "always" if step.get("add_prefix_space", True) else "never"
    return replacement, scheme != "never"


def _wordpiece(step: Mapping[str, Any]) -> Callable[[str, bool], str]:
    prefix, cleanup = step.get("prefix", "##"), step.get("cleanup", True)

    def wordpiece(token: str, first: bool) -> str:
        if not first:
            token = token.replace(prefix, "", 1) if token.startswith(prefix) else " " + token
        if cleanup:
            for dirty, clean in _WORDPIECE_CLEANUP:
                token = token.replace(dirty, clean)
        return token

    return wordpiece


def _replace_pattern(step: Mapping[str, Any]) -> tuple[str, str] | None:
    pattern, content = step.get("pattern"), step.get("content")
    if not isinstance(pattern, Mapping) or not isinstance(pattern.get("String"), str):
        return None  # regex patterns: Rust and Python regex dialects differ
    if not isinstance(content, str):
        return None
    return pattern["String"], content


def _pre_fuse_stage(step: Mapping[str, Any]) -> Any:
    kind = step.get("type")
    if kind == "Replace":
        pair = _replace_pattern(step)
        if pair is None:
            return None
        old, new = pair
        return lambda: _Map(lambda token, first: token.replace(old, new))
    if kind == "ByteFallback":
        return _ByteFallback
    if kind == "Strip":
        fn = _strip(step.get("content", " "), int(step.get("start", 0)), int(step.get("stop", 0)))
        return lambda: _Map(fn)
    if kind == "Metaspace":
        replacement, prepend = _metaspace(step)

        def metaspace(token: str, first: bool) -> str:
            return token.replace(replacement, "" if first and prepend else " ")

        return lambda: _Map(metaspace)
    if kind == "WordPiece":
        fn = _wordpiece(step)
        return lambda: _Map(fn)
    return None


def _post_fuse_stage(step: Mapping[str, Any]) -> Any:
    kind = step.get("type")
    if kind == "Fuse":
        return lambda: _ChunkMap(lambda text: text)
    if kind == "Strip" and int(step.get("stop", 0)) == 0:
        content, start = step.get("content", " "), int(step.get("start", 0))
        return lambda: _StripLeading(content, start)
    if kind == "Replace":
        pair = _replace_pattern(step)
        if pair is None or len(pair[0]) != 1:
            return None  # a longer pattern could span chunks
        old, new = pair
        return lambda: _ChunkMap(lambda text: text.replace(old, new))
    if kind == "Metaspace":
        replacement, prepend = _metaspace(step)  # the fused string is the first token
        new = "" if prepend else " "
        return lambda: _ChunkMap(lambda text: text.replace(replacement, new))
    if kind == "WordPiece" and not step.get("cleanup", True):
        return lambda: _ChunkMap(lambda text: text)  # the one token is the first: untouched
    return None


class DecoderChain:
    """A compiled decoder: factories for the stages one stream runs through."""

    def __init__(self, before: list[Any], fuse: Any, after: list[Any]):
        self._before, self._fuse, self._after = before, fuse, after

    def stages(self) -> tuple[list[Any], Any, list[Any]]:
        return [f() for f in self._before], self._fuse(), [f() for f in self._after]


def compile_decoder(decoder: Any) -> DecoderChain | None:
    """The streaming form of a ``tokenizer.json`` ``decoder`` entry, or None when some
    step cannot be streamed exactly. ``None`` (no decoder) joins tokens with spaces."""
    if decoder is None:
        return DecoderChain([lambda: _Map(lambda t, first: t if first else " " + t)], _Join, [])
    steps = _flatten(decoder)
    if steps is None:
        return None
    before, fuse, after = [], None, []
    for step in steps:
        if fuse is None:
            if isinstance(step, Mapping) and step.get("type") == "Fuse":
                fuse = _Join
                continue
            if isinstance(step, Mapping) and step.get("type") == "ByteLevel":
                fuse = _ByteLevel
                continue
            stage = _pre_fuse_stage(step) if isinstance(step, Mapping) else None
            if stage is None:
                return None
            before.append(stage)
        else:
            stage = _post_fuse_stage(step) if isinstance(step, Mapping) else None
            if stage is None:
                return None
            after.append(stage)
    return DecoderChain(before, fuse or _Join, after)


class StreamingDetokenizer:
    """Turns token ids into text one id at a time, holding back what is not final yet.

    ``add(id)`` returns the text that became final with this id (often ``""`` while a
    multi-byte character or a run of byte tokens is still arriving); ``flush()`` returns
    the rest at the end. The concatenation equals ``Tokenizer.decode`` of all ids.
    """

    def __init__(self, tokens: Sequence[str | None], chain: DecoderChain):
        self._tokens = tokens
        self._before, self._fuse, self._after = chain.stages()
        # A chain that only fuses (byte-level BPE's) takes each token straight to its fuse
        # point: every running request detokenizes a token per step on the scheduler's thread.
        self._direct = self._fuse.push_one if not (self._before or self._after) else None

    def add(self, token: int) -> str:
        text = self._tokens[token] if 0 <= token < len(self._tokens) else None
        if text is None:  # the library skips ids it has no token for
            return ""
        if self._direct is not None:
            return self._direct(text)
        return self._run([text], final=False)

    def flush(self) -> str:
        return self._run([], final=True)

    def _run(self, tokens: list[str], *, final: bool) -> str:
        for stage in self._before:
            tokens = stage.push(tokens) + (stage.finish() if final else [])
        text = self._fuse.push(tokens) + (self._fuse.finish() if final else "")
        for stage in self._after:
            text = stage.push(text) + (stage.finish() if final else "")
        return text


class RedecodingDetokenizer:
    """Fallback for decoder chains :func:`compile_decoder` cannot stream: re-decode the
    whole sequence at each id and emit what grew, holding a trailing U+FFFD (a character
    whose other bytes may still come). Quadratic in the length; used only for rare decoders.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._emitted = ""

    def add(self, token: int) -> str:
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        return self._take(text)

    def flush(self) -> str:
        text = self._decode(self._ids) if self._ids else ""
        return self._take(text) if text.startswith(self._emitted) else ""

    def _take(self, text: str) -> str:
        fresh = text[len(self._emitted) :]
        self._emitted = text
        return fresh


def token_table(tokens: Iterable[tuple[str, int]]) -> list[str | None]:
    """id -> token string for a vocabulary given as ``(token, id)`` pairs."""
    pairs = list(tokens)
    table: list[str | None] = [None] * (max((i for _, i in pairs), default=-1) + 1)
    for token, index in pairs:
        table[index] = token
    return table
