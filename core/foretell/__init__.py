"""foretell: fast LLM inference on MLX, a minimal core plus plugins.

The core defines four extension points (model architectures, draft providers, KV-cache
codecs, storage layouts) as pluggy hook specs in :mod:`foretell.hookspecs`; plugins
register contributions through the ``foretell.plugins`` entry-point group.
"""

# First, before anything imports mlx: an optimized BLAS binds ahead of libmlx (docs/blas.md).
from foretell.blas import preload as _preload_blas

_preload_blas()

__version__ = "0.1.0"

#: The plugin-API version this core provides. A plugin or contribution that declares a
#: higher minimum is refused with both versions named. Bump on incompatible changes.
PLUGIN_API = 1

from foretell.hookspecs import hookimpl  # noqa: E402

__all__ = ["PLUGIN_API", "Engine", "__version__", "hookimpl", "load"]


def __getattr__(name: str):
    # The engine imports mlx; resolving it on first use keeps `import foretell` (and so
    # `foretell plugins`) fast.
    if name in ("load", "Engine"):
        from foretell import generate

        return getattr(generate, name)
    raise AttributeError(f"module 'foretell' has no attribute {name!r}")
