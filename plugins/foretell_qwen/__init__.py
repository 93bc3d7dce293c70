"""foretell's built-in Qwen plugin: the Qwen3 and Qwen2 dense architectures, and Qwen-MTP
(the target's own multi-token-prediction head) as a draft provider."""

import foretell


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
        summary="the target's own multi-token-prediction head (mtp.* weights) drafts",
    )
