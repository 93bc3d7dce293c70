"""foretell: fast LLM inference on MLX, a minimal core plus plugins.

The core defines four extension points (model architectures, draft providers, KV-cache
codecs, storage layouts) as pluggy hook specs in :mod:`foretell.plugin.hookspecs`; plugins
register contributions through the ``foretell.plugins`` entry-point group.

Importing this package is cheap and changes nothing in the process: pytest loads
foretell's plugin (``foretell.plugin.pytest_plugin``) in every session of every environment that
has foretell installed. The engine starts on first use of :func:`foretell.load` or
:class:`foretell.Engine`, and that is where the CPU's optimized BLAS is put under MLX.
"""

__version__ = "0.1.0"

#: The plugin-API version this core provides. A plugin or contribution that declares a
#: higher minimum is refused with both versions named. Bump on incompatible changes.
#: 2: drafters work on rows (``open_rows``, :mod:`foretell.spec.rows`); a drafter of API 1
#: (per-request ``open`` only) still speculates, one source per row.
PLUGIN_API = 2

from foretell.plugin.hookspecs import hookimpl  # noqa: E402

__all__ = ["PLUGIN_API", "Engine", "__version__", "hookimpl", "load"]


def __getattr__(name: str):
    if name in ("load", "Engine"):
        # The engine imports mlx; the BLAS must be bound first, or MLX keeps the reference
        # one for the life of the process (docs/blas.md).
        from foretell.platform import blas

        blas.preload()
        from foretell import engine

        value = globals()[name] = getattr(engine, name)
        return value
    raise AttributeError(f"module 'foretell' has no attribute {name!r}")
