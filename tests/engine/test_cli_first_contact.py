"""The CLI as a new user meets it: every path works or ends in one line naming the flag.

Each case here was a traceback or a surprise before (issue 11, part B).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import foretell
from foretell.cli import PIPE_CLOSED, main
from foretell.cli.run_cmd import DIM, UNDIM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from foretell.tools import make_model_dir

    return make_model_dir(
        tmp_path_factory.mktemp("first-contact") / "qwen3",
        "qwen3",
        overrides={"max_position_embeddings": 64},
    )


def run_main(argv, capsys, stdin: bytes | str | None = None, monkeypatch=None):
    if stdin is not None:
        stream = (
            io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
            if isinstance(stdin, bytes)
            else io.StringIO(stdin)
        )
        monkeypatch.setattr("sys.stdin", stream)
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("foretell: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- tracebacks on ordinary use ---------------------------------------------------------------


class ClosedPipe(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_closing_the_pipe_ends_the_run_quietly_in_process(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["run", "--model", str(model_dir), "--max-tokens", "8"]) == PIPE_CLOSED
    assert capsys.readouterr().err.count("Traceback") == 0


def test_foretell_run_piped_into_head_exits_141_without_a_traceback(model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "foretell", "run", "--model", str(model_dir),
         "--max-tokens", "60", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.readline()  # what `head -1` reads, then it goes away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == PIPE_CLOSED
    assert "Traceback" not in err and "Exception ignored" not in err


def test_non_utf8_bytes_on_stdin_are_one_error_naming_stdin(model_dir, capsys, monkeypatch):
    code, _, err = run_main(
        ["run", "--model", str(model_dir), "--prompt", "-"], capsys, b"def f\xff(x):", monkeypatch
    )
    assert code == 1
    assert one_line_error(err) == (
        "foretell: error: --prompt -: not UTF-8 text (byte 0xff at offset 5)"
    )


@pytest.mark.parametrize("given, name", [(["--prompt"], "--prompt"),
                                         ([], "the PROMPT argument")])
def test_non_utf8_bytes_in_the_prompt_are_one_error_naming_where(given, name, model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "foretell", "run", "--model", str(model_dir), *given,
         b"a\xfeb"],
        capture_output=True, timeout=120,
    )
    assert done.returncode == 1
    assert one_line_error(done.stderr.decode()) == (
        f"foretell: error: {name}: not UTF-8 text (byte 0xfe at character 1)"
    )


@pytest.mark.parametrize(
    ("seed", "says"),
    [("-1", "must be >= 0, got -1"), (str(2**64), f"must be < {2**64}, got {2**64}")],
)
def test_a_seed_outside_the_prng_range_is_refused_naming_the_flag(seed, says, model_dir, capsys):
    code, _, err = run_main(
        ["run", "--model", str(model_dir), "--temp", "0.7", "--seed", seed], capsys
    )
    assert code == 1
    assert one_line_error(err).endswith(f"sampling.seed: {says} (set by --seed)")


def test_the_largest_seed_samples(model_dir, capsys):
    argv = ["run", "--model", str(model_dir), "--temp", "0.7", "--seed", str(2**64 - 1),
            "--max-tokens", "3", "--json"]
    code, out, _ = run_main(argv, capsys)
    assert code == 0 and json.loads(out.splitlines()[-1])["generated_tokens"] == 3


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", ["--temp", "--top-p", "--min-p", "--repetition-penalty"])
def test_non_finite_numbers_are_refused_naming_the_flag(flag, value, model_dir, capsys):
    code, _, err = run_main(["run", "--model", str(model_dir), f"{flag}={value}"], capsys)
    assert code == 1
    assert "expected a finite number" in one_line_error(err) and f"(set by {flag})" in err


def test_non_finite_numbers_in_a_config_file_name_the_file(model_dir, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[sampling]\ntemp = nan\n")
    code, _, err = run_main(["run", "--model", str(model_dir), "--config", str(config)], capsys)
    assert code == 1
    assert one_line_error(err) == (
        f"foretell: error: {config}: sampling.temp: expected a finite number, got nan"
    )


# -- prompts ----------------------------------------------------------------------------------


def test_a_text_prompt_is_completed_raw_unless_chat_is_asked_for(model_dir, capsys):
    engine = foretell.load(model_dir)
    assert engine.tokenizer.has_chat_template
    prompt = "def quicksort(xs):"
    for flags, chat in (([], False), (["--chat"], True), (["--no-chat"], False)):
        argv = ["run", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "2",
                "--json", *flags]
        code, out, _ = run_main(argv, capsys)
        assert code == 0
        sent = json.loads(out.splitlines()[-1])["prompt_tokens"]
        assert sent == len(engine.encode_prompt(prompt, chat=chat)), flags
    assert len(engine.encode_prompt(prompt, chat=True)) != len(engine.encode_prompt(prompt, chat=False))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_prompt_is_shown_dimmed_before_the_completion(model_dir, capsys, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert main(["run", "--model", str(model_dir), "--prompt", "def f(x):", "--max-tokens", "4"]) == 0
    completion = foretell.load(model_dir).generate_text("def f(x):", max_tokens=4, chat=False)
    assert terminal.getvalue() == f"{DIM}def f(x):{UNDIM}{completion}\n"


def test_piped_and_json_output_never_carry_the_prompt(model_dir, capsys, monkeypatch):
    code, out, _ = run_main(["run", "--model", str(model_dir), "--prompt", "def f(x):",
                             "--max-tokens", "4"], capsys)
    assert code == 0 and "def f(x):" not in out and DIM not in out
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert main(["run", "--model", str(model_dir), "--prompt", "def f(x):", "--max-tokens", "4",
                 "--json"]) == 0
    events = [json.loads(line) for line in terminal.getvalue().splitlines()]
    assert DIM not in terminal.getvalue() and all(e["type"] in ("text", "stats") for e in events)


def test_max_tokens_past_the_context_warns_once(model_dir, capsys):
    code, _, err = run_main(["run", "--model", str(model_dir), "--max-tokens", "70", "--json"], capsys)
    assert code == 0
    assert err.count("warning:") == 1
    assert "--max-tokens 70" in err and "model's context of 64 tokens" in err
    code, _, err = run_main(["run", "--model", str(model_dir), "--max-tokens", "8", "--json"], capsys)
    assert code == 0 and "warning" not in err


def test_chat_warns_about_the_context_once_per_session(model_dir, capsys, monkeypatch):
    code, _, err = run_main(["chat", "--model", str(model_dir), "--max-tokens", "70"], capsys,
                            "one\ntwo\n", monkeypatch)
    assert code == 0 and err.count("model's context of 64 tokens") == 1


# -- smaller ----------------------------------------------------------------------------------


def spy_generate(monkeypatch) -> list[dict]:
    seen = []
    real = foretell.Engine.generate

    def spy(self, prompt, **options):
        # chat's history grows after the call: keep what was sent
        sent = prompt if isinstance(prompt, str) else [dict(m) for m in prompt]
        seen.append({"prompt": sent, **options})
        return real(self, prompt, **options)

    monkeypatch.setattr(foretell.Engine, "generate", spy)
    return seen


def test_stop_strings_are_unescaped_like_the_prompt(model_dir, capsys, monkeypatch):
    seen = spy_generate(monkeypatch)
    argv = ["run", "--model", str(model_dir), "--prompt", "a\\tb", "--stop", "\\n",
            "--stop", "x\\ty", "--max-tokens", "2"]
    assert main(argv) == 0
    (call,) = seen
    assert call["prompt"] == "a\tb" and list(call["stop"]) == ["\n", "x\ty"]


def test_chat_commands_are_never_sent_to_the_model(model_dir, capsys, monkeypatch):
    seen = spy_generate(monkeypatch)
    code, _, err = run_main(["chat", "--model", str(model_dir), "--max-tokens", "2"], capsys,
                            "/help\n/bogus\n /etc is a path\n", monkeypatch)
    assert code == 0
    assert [turn["prompt"][-1]["content"] for turn in seen] == [" /etc is a path"]
    assert "/reset" in err and "unknown command /bogus" in err


def test_chat_reports_a_non_utf8_line_and_carries_on(model_dir, capsys, monkeypatch):
    seen = spy_generate(monkeypatch)
    code, _, err = run_main(["chat", "--model", str(model_dir), "--max-tokens", "2"], capsys,
                            b"bad \xff line\nfine\n", monkeypatch)
    assert code == 0
    assert "stdin: not UTF-8 text (byte 0xff at offset 4)" in err
    assert [turn["prompt"][-1]["content"] for turn in seen] == ["fine"]


@pytest.mark.parametrize("flag", ["--top-k", "--repetition-context-size"])
def test_token_counts_beyond_mlx_indices_are_refused_naming_the_flag(flag, model_dir, capsys):
    code, _, err = run_main(["run", "--model", str(model_dir), flag, str(2**64 - 1)], capsys)
    assert code == 1
    assert one_line_error(err).endswith(f"must be <= 2147483647, got {2**64 - 1} (set by {flag})")


def test_an_undecodable_file_name_is_shown_not_a_crash(model_dir, capsys):
    code, _, err = run_main(["run", "--model", str(model_dir), "--config", "\udcff.toml"], capsys)
    assert code == 1 and "\\xff.toml" in one_line_error(err)


def test_ctrl_c_in_chat_abandons_the_reply_and_forgets_the_turn(model_dir, capsys, monkeypatch):
    sent = []
    real = foretell.Engine.generate

    def interrupted_once(self, prompt, **options):
        sent.append([dict(m) for m in prompt])
        events = real(self, prompt, **options)
        if len(sent) == 1:  # Ctrl-C after the first token of the first reply
            yield next(events)
            raise KeyboardInterrupt
        yield from events

    monkeypatch.setattr(foretell.Engine, "generate", interrupted_once)
    code, _, err = run_main(["chat", "--model", str(model_dir), "--max-tokens", "3"], capsys,
                            "first\nsecond\n", monkeypatch)
    assert code == 0 and "(interrupted)" in err
    assert sent[1] == [{"role": "user", "content": "second"}]


@pytest.mark.parametrize(
    ("terminal", "flags", "shown"),
    [(True, [], True), (True, ["--json"], False), (False, [], False)],
    ids=["terminal", "terminal-json", "piped"],
)
def test_progress_lines_are_drawn_on_a_terminal_only_and_never_with_json(
    terminal, flags, shown, model_dir, monkeypatch
):
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert main(["run", "--model", str(model_dir), "--max-tokens", "2", *flags]) == 0
    assert (f"loading {model_dir.name}" in stderr.getvalue()) == shown, stderr.getvalue()


def test_chat_system_is_unescaped_and_checked_like_the_prompt(model_dir, capsys, monkeypatch):
    seen = spy_generate(monkeypatch)
    code, _, err = run_main(["chat", "--model", str(model_dir), "--system", "Be\\tbrief.\\n",
                             "--max-tokens", "2"], capsys, "hi\n", monkeypatch)
    assert code == 0
    assert seen[0]["prompt"][0] == {"role": "system", "content": "Be\tbrief.\n"}
    code, _, err = run_main(["chat", "--model", str(model_dir), "--system",
                             b"a\xfe".decode("utf-8", "surrogateescape")], capsys, "hi\n",
                            monkeypatch)
    assert code == 1
    assert one_line_error(err) == "foretell: error: --system: not UTF-8 text (byte 0xfe at character 1)"
