"""Every error foretell reports to a user, in one hierarchy under :class:`ForetellError`.

Each says what was wrong, where (file, field, flag or plugin), and what to do. The modules
that raise them re-export them where they are used (``foretell.engine.GenerationError``
is this ``GenerationError``), so either import works; this page is where they are defined.
The CLI prints a ``ForetellError`` as one line and exits 1; anything else is a bug.
"""

from __future__ import annotations


class ForetellError(Exception):
    """Base of every error foretell reports to a user as one line (or a few)."""


# -- plugins and configuration ------------------------------------------------------------


class PluginError(ForetellError):
    """A plugin failed to load, conflicts with another, or needs a newer core."""


class ContributionConflict(PluginError):
    """Two plugins contribute the same name for the same extension point."""


class UnknownContribution(ForetellError):
    """A configuration selects a name that no loaded plugin contributes."""


class ConfigError(ForetellError):
    """A configuration file or flag is invalid; ``lines`` holds one message per problem."""

    def __init__(self, source: str, lines: list[str]):
        self.source = source
        self.lines = list(lines)
        super().__init__("\n".join(f"{source}: {line}" for line in self.lines))


# -- models ---------------------------------------------------------------------------------


class ModelNotFound(ForetellError):
    """A model name is neither a directory nor a shipped model.

    The message names what the caller gave: ``model 'x'`` from Python, ``--model x`` when
    the CLI passes ``flag``.
    """

    def __init__(self, name: str, reason: str, *, flag: str | None = None):
        self.name = name
        self.reason = reason
        self.flag = flag
        where = f"{flag} {name}" if flag else f"model {name!r}"
        super().__init__(f"{where}: {reason}")


class ModelLoadError(ForetellError):
    """A model directory is missing a file, holds a corrupt one, or does not match its config."""


class TokenizerError(ModelLoadError):
    """A tokenizer file is missing, corrupt, or names a token its vocabulary lacks."""


class ChatTemplateError(ForetellError):
    """The chat template is invalid, or refused the conversation (``raise_exception``)."""


# -- serving ------------------------------------------------------------------------------


class GenerationError(ForetellError):
    """A request cannot be served as given (empty prompt, bad token ids, ...)."""


class QueueFull(GenerationError):
    """The batch scheduler's waiting queue is at its bound: retry later (a server's 429)."""


# -- speculative decoding -------------------------------------------------------------------


class PairingError(ForetellError):
    """A drafter cannot serve this target (a missing port, another vocabulary...)."""


class DraftError(ForetellError):
    """A draft source failed inside a request; the request ends, the engine serves on."""


# -- the cache tier and its storage ---------------------------------------------------------


class CodecError(ForetellError):
    """No codec (or more than one) handles a cache, or a stored layer names none loaded."""


class StoreError(ForetellError):
    """A storage layout cannot serve a request (bad root, damaged entry...)."""


class CorruptEntry(StoreError):
    """The stored bytes are damaged or not an entry at all: never serve them, delete them."""


class UnknownVersion(StoreError):
    """Written by another format version: skip it, leave it for the foretell that wrote it."""


class ForeignEntry(StoreError):
    """Intact, but written for another model, tokenizer or codec: never serve it."""


class NotAFile(StoreError):
    """A path named like a store file that is not a regular file (a FIFO, a device, a
    directory, a socket): it is never read (a FIFO's open waits for a writer forever, a
    device reads without end) and never deleted (it is not something a layout wrote).
    Layouts skip it and say so (``foretell.store.ReportsSkipped``)."""


# -- tools --------------------------------------------------------------------------------


class BenchError(ForetellError):
    """``foretell bench`` cannot run as asked (no model named, a side failed, a missing
    dependency, ...)."""


class TemplateOverflow(ForetellError):
    """A chat template's render passed its size bound (the message says how); the tokenizer
    reports it as an error naming the template's file."""
