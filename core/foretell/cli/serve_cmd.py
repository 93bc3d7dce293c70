"""``foretell serve``: the model behind OpenAI- and Anthropic-compatible HTTP APIs.

Takes ``run``'s model, sampling, drafter and cache flags and its TOML ``--config``: the
sampling flags and ``--max-tokens`` are the defaults for requests that do not say, the
drafter is the one requests use unless they choose another. The server's own settings (where
it listens, who may call it and how much it takes at once) are the config's ``[serve]``
table, each also a flag; a flag overrides the file. docs/serve.md has the rest.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from typing import Any

from foretell.cli.run_cmd import add_run_flags, apply_draft, open_engine, run_config
from foretell.errors import ForetellError

#: Where the API key may come from instead of the command line (which others can read).
API_KEY_ENV = "FORETELL_API_KEY"
#: The serve extra's packages (pyproject.toml), as imported.
SERVE_PACKAGES = ("starlette", "uvicorn", "llguidance")
#: The server's flags, each a ``[serve]`` key (``--api-key`` too: :func:`serve_overrides`).
_SERVE_FLAGS = ("host", "port", "served_model_name", "max_rows", "max_waiting",
                "kv_budget_gb", "access_log", "warm_shapes")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI- and Anthropic-compatible "
                                     "HTTP APIs")
    add_run_flags(p, resume=False)
    p.add_argument("--host", default=None,
                   help="the address to listen on; 0.0.0.0 opens it to the network (default: "
                        "127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="the port; 0 picks a free one (default: 8080)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"requests must carry this key (default: ${API_KEY_ENV}, else the "
                        "config's [serve] api_key or api_key_env, else none needed)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the "
                        "model directory's name)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="the most requests decoding together (default: 32)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests that may wait for a row; beyond, a 429 with Retry-After "
                        "(default: 256)")
    p.add_argument("--kv-budget-gb", type=float, default=None, metavar="GB",
                   help="KV cache the running requests may hold, GiB (default: 40%% of the "
                        "device's memory)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                   help="log each HTTP request (default: on)")
    p.add_argument("--warm-shapes", action=argparse.BooleanOptionalAction, default=None,
                   help="where the device compiles per shape (MLX-CUDA), compile every row "
                        "count's shapes before listening (default: on)")
    p.set_defaults(handler=run)


def serve_overrides(args: argparse.Namespace,
                    environ: Any = os.environ) -> dict[str, tuple[Any, str]]:
    """The ``[serve]`` keys the flags set, and the key ``$FORETELL_API_KEY`` holds when
    ``--api-key`` is not given (over the file's: the environment is the deployment's)."""
    out: dict[str, tuple[Any, str]] = {}
    for attr in _SERVE_FLAGS:
        value = getattr(args, attr)
        flag = "--" + ("no-" if value is False else "") + attr.replace("_", "-")
        out[f"serve.{attr}"] = (value, flag)
    if args.api_key is not None:
        out["serve.api_key"] = (args.api_key, "--api-key")
    elif environ.get(API_KEY_ENV):
        out["serve.api_key"] = (environ[API_KEY_ENV], f"${API_KEY_ENV}")
    return out


def serve_config(args: argparse.Namespace, environ: Any = os.environ) -> tuple[Any, Any, str | None]:
    """The plugin registry, the run config (``[serve]`` included) and the API key, from
    ``--config``, the flags and the environment; nothing is loaded or bound."""
    registry, config = run_config(args, serve_overrides(args, environ))
    return registry, config, serve_api_key(config.serve, args.config or "command line", environ)


def run(args: argparse.Namespace) -> int:
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ForetellError(f"foretell serve needs {', '.join(missing)}: install the serve "
                            "extra (pip install '.[serve]' in foretell's checkout)")
    registry, config, api_key = serve_config(args)
    if config.cache.resume:
        print("foretell serve: note: [cache] resume applies to `foretell run` only; ignored "
              "here", file=sys.stderr)
    settings = config.serve
    from foretell.serve.server import listen

    sock = listen(settings.host, settings.port)  # a taken port fails before the model loads
    # Every request's prompt and reply stay in RAM (and on disk with --cache-dir), so a
    # conversation's next turn and a shared system prompt are computed once.
    engine = open_engine(config.model, registry, quiet=False, cache=config.cache,
                         ram_cache=True)
    apply_draft(engine, config.draft, registry, quiet=False)
    from foretell.scheduler import Scheduler
    from foretell.serve.generation import Backend
    from foretell.serve.server import serve

    budget = int(settings.kv_budget_gb * 2**30) if settings.kv_budget_gb is not None else None
    scheduler = Scheduler(engine, max_rows=settings.max_rows, kv_budget_bytes=budget,
                          max_waiting=settings.max_waiting)
    if settings.warm_shapes:
        _warm_batches(scheduler)
    names = [settings.served_model_name or engine.path.name]
    if config.model and config.model not in names:
        names.append(config.model)  # the name it was started with works too
    stops = list(engine.tokenizer.stop_strings) if args.model_stops else []
    backend = Backend(engine, scheduler, served=names, max_tokens=config.max_tokens,
                      sampling=config.sampling, model_stops=stops)
    return serve(backend, sock, api_key=api_key, access_log=settings.access_log)


def _warm_batches(scheduler: Any) -> None:
    """Each row count's shapes compiled before the first request where the device compiles
    per shape (:mod:`foretell.batch_warmup`), saying so: minutes on a host's first run."""
    from foretell.batch_warmup import warm_batches
    from foretell.spec.warmup import compiles_per_shape

    if not compiles_per_shape():
        return
    print(f"foretell serve: compiling the shapes of 1-{scheduler.max_rows} rows at once ...",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    warm_batches(scheduler)
    print(f"foretell serve: shapes ready in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)


def serve_api_key(section: Any, source: str, environ: Any) -> str | None:
    """The key ``foretell serve`` requires: ``api_key``, or the value of the variable
    ``api_key_env`` names; None: no key.

    :raises ConfigError: the variable is unset or empty, or holds no usable key (a server
        the operator meant to lock must not start open)."""
    if section.api_key_env is None:
        return section.api_key
    name = section.api_key_env
    key = environ.get(name, "")
    if not key:
        from foretell.errors import ConfigError

        raise ConfigError(source, [f"serve.api_key_env: ${name} is not set or is empty in the "
                                   "server's environment: export the key in it, or leave "
                                   "api_key_env out to serve without a key"])
    from foretell.config import api_key_problem
    from foretell.errors import ConfigError

    if (problem := api_key_problem(key)) is not None:
        raise ConfigError(source, [f"serve.api_key_env: the key in ${name} {problem}"])
    return key
