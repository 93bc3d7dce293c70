"""Errors a user can hit. Each says what was wrong, where, and what to do."""


class ForetellError(Exception):
    """Base of every error foretell reports to a user as one line (or a few)."""


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


class ModelLoadError(ForetellError):
    """A model directory is missing a file, holds a corrupt one, or does not match its config."""
