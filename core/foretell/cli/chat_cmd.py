"""``foretell chat``: a multi-turn conversation at the terminal.

The whole history goes through the model's chat template each turn. ``/reset`` starts
over, ``/exit`` or end of input (Ctrl-D) quits; Ctrl-C during a reply abandons that reply.
Replies go to stdout; the prompt marker and speed notes go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from foretell.cli.run_cmd import add_run_flags, open_engine, run_config
from foretell.errors import ForetellError
from foretell.tokenizer import ChatTemplateError

PROMPT_MARKER = ">> "


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="talk with a model: a multi-turn REPL")
    add_run_flags(p)
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    registry, config = run_config(args)
    engine = open_engine(config.model, registry, quiet=False)
    if not engine.tokenizer.has_chat_template:
        raise ChatTemplateError(
            f"{engine.path}: this model has no chat template, so it cannot chat; "
            "use `foretell run --no-chat` to complete plain text"
        )
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    err = sys.stderr
    err.write("Type a message. /reset clears the conversation; /exit or Ctrl-D quits.\n")
    while True:
        err.write(PROMPT_MARKER)
        err.flush()
        line = sys.stdin.readline()
        if not line:  # end of input
            err.write("\n")
            return 0
        message = line.rstrip("\n")
        command = message.strip()
        if not command:
            continue
        if command == "/exit":
            return 0
        if command == "/reset":
            history = list(opening)
            err.write("(conversation cleared)\n")
            continue
        history.append({"role": "user", "content": message})
        reply = []
        try:
            for event in engine.generate(
                history, max_tokens=config.max_tokens, sampling=config.sampling
            ):
                if event.type == "text":
                    reply.append(event.text)
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                else:
                    stats = event
        except KeyboardInterrupt:
            history.pop()  # the turn never completed; forget it
            err.write("\n(interrupted)\n")
            continue
        except ForetellError as exc:
            # e.g. a template that refuses this turn: say so, keep the conversation going
            history.pop()
            err.write(f"foretell: error: {exc}\n")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
        err.write(
            f"({stats.generated_tokens} tokens, {stats.generation_tps:.1f} tok/s, "
            f"TTFT {stats.ttft_s:.2f}s)\n"
        )
