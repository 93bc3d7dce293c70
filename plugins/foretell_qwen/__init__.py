"""foretell's built-in Qwen plugin: the Qwen3 and Qwen2 dense architectures, and Qwen-MTP
(the target's own multi-token-prediction head) as a draft provider."""

import attrs

import foretell


def _non_negative(_inst, attribute, value):
    if value < 0:
        raise ValueError(f"'{attribute.name}' must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class MTPConfig:
    """``[draft] kind = "mtp"``."""

    draft_vocab: int = attrs.field(
        default=0, validator=_non_negative,
        metadata={"help": "draft from the ids below this only (a shortlist head, cheaper on "
                          "CPUs); 0 or the vocabulary size: the whole vocabulary"},
    )


@foretell.hookimpl
def foretell_register_architectures(register):
    register("qwen3", "foretell_qwen.qwen3:build", summary="Qwen3 dense decoder (q/k RMSNorm)",
             synthetic="foretell_qwen.synthetic:QWEN3")
    register("qwen2", "foretell_qwen.qwen2:build", summary="Qwen2 / Qwen2.5 dense decoder",
             synthetic="foretell_qwen.synthetic:QWEN2")


@foretell.hookimpl
def foretell_register_draft_providers(register):
    register(
        "mtp",
        "foretell_qwen.mtp:MTPProvider",
        config=MTPConfig,
        summary="the target's own multi-token-prediction head (mtp.* weights) drafts, up to 6 a round",
    )
