"""foretell's built-in Gemma plugin: the Gemma 3 and Gemma 4 dense text architectures."""

import foretell


@foretell.hookimpl
def foretell_register_architectures(register):
    register(
        "gemma3_text",
        "foretell_gemma.gemma3_text:build",
        summary="Gemma 3 text decoder (interleaved sliding/global attention)",
        synthetic="foretell_gemma.synthetic:GEMMA3_TEXT",
    )
    register(
        "gemma4_text",
        "foretell_gemma.gemma4_text:build",
        summary="Gemma 4 dense text decoder (KV sharing, per-layer inputs, partial RoPE)",
        synthetic="foretell_gemma.synthetic:GEMMA4_TEXT",
    )
