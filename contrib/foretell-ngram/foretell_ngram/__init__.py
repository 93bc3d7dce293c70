"""foretell-ngram: a prompt-lookup draft provider registered through ``foretell.plugins``."""

import attrs

from foretell import hookimpl

#: Its rows (``NgramRows``) need plugin API 2's draft contract.
FORETELL_PLUGIN_API = 2


def _positive(_inst, attribute, value):
    if value < 1:
        raise ValueError(f"'{attribute.name}' must be >= 1, got {value!r}")


def _non_negative(_inst, attribute, value):
    if value < 0:
        raise ValueError(f"'{attribute.name}' must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class NgramConfig:
    #: The deepest suffix match looked up; a match this deep proposes every token asked for.
    max_ngram: int = attrs.field(default=4, validator=_positive)
    min_ngram: int = attrs.field(default=1, validator=_positive)
    #: A shallower match of ``s`` tokens proposes at most ``tokens_per_match * s``; 0: no limit.
    tokens_per_match: int = attrs.field(default=2, validator=_non_negative)

    def __attrs_post_init__(self):
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"'min_ngram' ({self.min_ngram}) must be <= 'max_ngram' ({self.max_ngram})")


@hookimpl
def foretell_register_draft_providers(register):
    register(
        "ngram",
        "foretell_ngram.lookup:NgramProvider",
        config=NgramConfig,
        summary="prompt lookup: propose what followed the last matching n-gram, up to 16 a round",
    )
