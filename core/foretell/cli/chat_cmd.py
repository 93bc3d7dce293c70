"""``foretell chat``: a multi-turn conversation at the terminal.

The whole history goes through the model's chat template each turn. A model without a
chat template completes text (the demo models: Python source): chat says so at the start,
and each turn the model continues the transcript, every message starting a new line, each
reply ending at the model's stop strings (docs/decisions.md). A line starting
with ``/`` is a command, never sent to the model: ``/help``, ``/reset`` (start over),
``/exit`` (or end of input, Ctrl-D); an unknown one-word ``/name`` is refused with the
list (start the line with a space to send it as a message). Ctrl-C
during a reply abandons that reply. Replies go to stdout; the prompt marker and speed
notes go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from foretell.cli import text
from foretell.cli.run_cmd import (
    add_run_flags,
    apply_draft,
    model_stops,
    open_engine,
    run_config,
    speculation_line,
    warn_past_context,
)
from foretell.errors import ForetellError

PROMPT_MARKER = ">> "
COMMANDS = {
    "/help": "show these commands",
    "/reset": "clear the conversation",
    "/exit": "quit (so does Ctrl-D)",
}
HELP = "\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items())


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="talk with a model: a multi-turn REPL")
    add_run_flags(p, resume=False)
    p.add_argument("--system", default=None, help="a system message that opens the conversation "
                   "(default: none)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    registry, config = run_config(args)
    if config.cache.resume:  # a config file shared with `run` may set it
        print("foretell chat: note: [cache] resume applies to `foretell run` only (a "
              "conversation lives in this process); ignored here", file=sys.stderr)
    # Each turn's prompt + reply stays in RAM (and on disk with --cache-dir), so the next
    # turn computes only what is new.
    engine = open_engine(config.model, registry, quiet=False, cache=config.cache, ram_cache=True)
    apply_draft(engine, config.draft, registry, quiet=False)  # the same drafter as `run`
    from foretell.cli.cache_cmd import flushing

    with flushing(engine.cache):
        return converse(args, config, engine)


def transcript(history: list[dict[str, str]]) -> str:
    """A conversation as a model without a chat template sees it: one text in which each
    message starts a new line and each reply continues the message before it."""
    out = ""
    for message in history:
        if message["role"] != "assistant" and out and not out.endswith("\n"):
            out += "\n"
        out += message["content"]
    return out


def converse(args: argparse.Namespace, config: Any, engine: Any) -> int:
    templated = engine.tokenizer.has_chat_template
    stops = model_stops(engine, args)
    system = text.unescape(text.checked(args.system, "--system")) if args.system else None
    opening = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    err = sys.stderr
    if not templated:
        err.write(
            f"{engine.path.name} has no chat template: it completes text rather than following "
            "instructions. Each message goes on a new line of one growing text that the model "
            "continues"
            + (f" up to its stop strings ({', '.join(map(repr, stops))})" if stops else "")
            + "; /reset starts over.\n"
        )
    err.write("Type a message. /help lists the commands; /exit or Ctrl-D quits.\n")
    warned = False
    while True:
        err.write(PROMPT_MARKER)
        err.flush()
        try:
            line = text.read_stdin_line("stdin")
        except ForetellError as exc:
            err.write(f"foretell: error: {exc}; line ignored\n")
            continue
        if not line:  # end of input
            err.write("\n")
            return 0
        message = line.rstrip("\n")
        command = message.strip()
        if not command:
            continue
        # A command starts the line; " /etc is a path" (leading space) goes to the model.
        if message.startswith("/") and command.split()[0] in COMMANDS:
            name = command.split()[0]
            if name == "/exit":
                return 0
            if name == "/reset":
                history = list(opening)
                err.write("(conversation cleared)\n")
            else:
                err.write(HELP + "\n")
            continue
        if message.startswith("/") and " " not in command:
            # A typo'd command must not become a message to the model.
            err.write(f"unknown command {command}; the commands are:\n{HELP}\n")
            continue
        history.append({"role": "user", "content": message})
        reply = []
        try:
            prompt = history if templated else transcript(history)
            if not warned:
                ids = engine.encode_prompt(prompt)
                warned = warn_past_context(engine, ids, config.max_tokens)
            for event in engine.generate(
                prompt, max_tokens=config.max_tokens, sampling=config.sampling, stop=stops
            ):
                if event.type == "text":
                    reply.append(event.text)
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                else:
                    stats = event
        except KeyboardInterrupt as exc:
            from foretell.cli.cache_cmd import Terminated

            if isinstance(exc, Terminated):
                raise  # SIGTERM ends the session, not the turn
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
        spec = speculation_line(stats)
        err.write(
            f"({stats.generated_tokens} tokens, {stats.generation_tps:.1f} tok/s, "
            f"TTFT {stats.ttft_s:.2f}s, {stats.cached_tokens} prompt tokens cached"
            + (f"; drafter {spec}" if spec else "") + ")\n"
        )
