"""``foretell serve``: the model behind OpenAI- and Anthropic-compatible HTTP APIs.

Takes ``run``'s model, sampling, drafter and cache flags (and its TOML ``--config``): the
sampling flags and ``--max-tokens`` are the defaults for requests that do not say, the
drafter is the one requests use unless they choose another. The server's own flags say
where it listens, who may call it and how much it takes at once. docs/serve.md has the rest.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from foretell.cli.run_cmd import add_run_flags, apply_draft, open_engine, run_config
from foretell.errors import ConfigError, ForetellError

#: Where the API key may come from instead of the command line (which others can read).
API_KEY_ENV = "FORETELL_API_KEY"
#: The serve extra's packages (pyproject.toml), as imported.
SERVE_PACKAGES = ("starlette", "uvicorn", "llguidance")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI- and Anthropic-compatible "
                                     "HTTP APIs")
    add_run_flags(p, resume=False)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on; 0.0.0.0 opens it to the network")
    p.add_argument("--port", type=int, default=8080, help="the port; 0 picks a free one")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"requests must carry this key (default: ${API_KEY_ENV}, else none "
                        "needed)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the "
                        "model directory's name)")
    p.add_argument("--max-rows", type=int, default=32,
                   help="the most requests decoding together")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for a row; beyond, a 429 with Retry-After")
    p.add_argument("--kv-budget-gb", type=float, default=None, metavar="GB",
                   help="KV cache the running requests may hold, GiB (default: 40%% of the "
                        "device's memory)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log each HTTP request")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port {args.port}: must be 0-65535")
    if args.max_rows < 1:
        problems.append(f"--max-rows {args.max_rows}: must be at least 1")
    if args.max_waiting < 0:
        problems.append(f"--max-waiting {args.max_waiting}: must be at least 0")
    if args.kv_budget_gb is not None and not args.kv_budget_gb > 0:
        problems.append(f"--kv-budget-gb {args.kv_budget_gb}: must be more than 0")
    if problems:
        raise ConfigError("command line", problems)
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ForetellError(f"foretell serve needs {', '.join(missing)}: install the serve "
                            "extra (pip install '.[serve]' in foretell's checkout)")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    registry, config = run_config(args)
    if config.cache.resume:
        print("foretell serve: note: [cache] resume applies to `foretell run` only; ignored "
              "here", file=sys.stderr)
    from foretell.serve.server import listen

    sock = listen(args.host, args.port)  # a taken port fails before the model loads
    # Every request's prompt and reply stay in RAM (and on disk with --cache-dir), so a
    # conversation's next turn and a shared system prompt are computed once.
    engine = open_engine(config.model, registry, quiet=False, cache=config.cache,
                         ram_cache=True)
    apply_draft(engine, config.draft, registry, quiet=False)
    from foretell.scheduler import Scheduler
    from foretell.serve.generation import Backend
    from foretell.serve.server import serve

    budget = int(args.kv_budget_gb * 2**30) if args.kv_budget_gb is not None else None
    scheduler = Scheduler(engine, max_rows=args.max_rows, kv_budget_bytes=budget,
                          max_waiting=args.max_waiting)
    names = [args.served_model_name or engine.path.name]
    if config.model and config.model not in names:
        names.append(config.model)  # the name it was started with works too
    stops = list(engine.tokenizer.stop_strings) if args.model_stops else []
    backend = Backend(engine, scheduler, served=names, max_tokens=config.max_tokens,
                      sampling=config.sampling, model_stops=stops)
    return serve(backend, sock, api_key=api_key, access_log=args.access_log)
