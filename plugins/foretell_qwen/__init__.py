"""foretell's built-in Qwen plugin: the Qwen3 and Qwen2 dense architectures."""

import foretell


@foretell.hookimpl
def foretell_register_architectures(register):
    register("qwen3", "foretell_qwen.qwen3:build", summary="Qwen3 dense decoder (q/k RMSNorm)")
    register("qwen2", "foretell_qwen.qwen2:build", summary="Qwen2 / Qwen2.5 dense decoder")
