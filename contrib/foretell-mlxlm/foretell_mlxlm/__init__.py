"""foretell-mlxlm: every mlx-lm architecture as a foretell architecture.

Each ``model_type`` mlx-lm implements is registered as a *fallback*: a plugin that implements
the type natively (foretell's qwen3, gemma3_text, ...) serves it instead, whatever the load
order. An adapted model runs mlx-lm's own module code and caches; its caches are stored by
the ``mlx-lm`` codec, so the prefix cache, the SSD tier and ``--resume`` work for it.
"""

from foretell import hookimpl

FORETELL_PLUGIN_API = 1


@hookimpl
def foretell_register_architectures(register):
    from foretell_mlxlm.zoo import model_types

    for model_type, module in model_types().items():
        register(model_type, "foretell_mlxlm.adapter:build", fallback=True,
                 summary=f"mlx-lm's models/{module}.py",
                 synthetic=f"foretell_mlxlm.tiny:{spec_name(model_type)}")


@hookimpl
def foretell_register_cache_codecs(register):
    register("mlx-lm", "foretell_mlxlm.caches:MlxLmCacheCodec",
             summary="every mlx-lm cache kind an adapted model uses (KV, rotating, arrays, ...)")


def spec_name(model_type: str) -> str:
    """The attribute of :mod:`foretell_mlxlm.tiny` naming ``model_type``'s synthetic spec."""
    return "spec_" + model_type.replace("-", "_").replace(".", "_")
