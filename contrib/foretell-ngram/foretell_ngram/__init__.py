"""foretell-ngram: a prompt-lookup draft provider registered through ``foretell.plugins``."""

import attrs

from foretell import hookimpl


def _positive(_inst, attribute, value):
    if value < 1:
        raise ValueError(f"'{attribute.name}' must be >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class NgramConfig:
    max_ngram: int = attrs.field(default=3, validator=_positive)
    min_ngram: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self):
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"'min_ngram' ({self.min_ngram}) must be <= 'max_ngram' ({self.max_ngram})")


@hookimpl
def foretell_register_draft_providers(register):
    register(
        "ngram",
        "foretell_ngram.lookup:NgramProvider",
        config=NgramConfig,
        summary="prompt lookup: propose what followed the last matching n-gram",
    )
