"""foretell's built-in two-model drafter: any installed architecture drafts for a target
that shares its vocabulary (``--draft-model DIR``, mlx-lm's flag)."""

import attrs

import foretell


@attrs.frozen(kw_only=True)
class TwoModelConfig:
    """``[draft] kind = "two-model"``."""

    model: str = attrs.field(
        default="demo-draft",
        metadata={"help": "the draft model: a directory or a shipped model's name"},
    )


@foretell.hookimpl
def foretell_register_draft_providers(register):
    register(
        "two-model",
        "foretell_two_model.source:TwoModelProvider",
        config=TwoModelConfig,
        summary="a smaller model of the same vocabulary drafts for the target",
    )
