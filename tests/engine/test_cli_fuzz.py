"""Property: whatever flags, values and bytes a person types, the CLI works or ends in one
line naming the problem (exit 1 for a ForetellError, 2 for argparse), never a traceback.

In-process ``main()`` against one tiny model loaded once (``open_engine`` is patched to
hand it back, and generation is capped at a few tokens so a huge --max-tokens stays fast);
the real-process cases live in test_cli_first_contact.py.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import foretell
from foretell.cli import main, run_cmd

RUN_FLAGS = {
    "--max-tokens": "int",
    "--temp": "float",
    "--top-p": "float",
    "--top-k": "int",
    "--min-p": "float",
    "--seed": "int",
    "--repetition-penalty": "float",
    "--repetition-context-size": "int",
    "--prompt": "text",
    "--stop": "text",
    "--model": "text",
    "--config": "text",
    "--draft": "draft",
    "--num-draft-tokens": "int",
    "--draft-option": "text",
    "--cache-max-gb": "float",
    "--kv-bits": "int",
    "--cache-layout": "text",
}
SWITCHES = ["--chat", "--no-chat", "--json", "--resume"]
#: --cache-dir is only ever this directory: a drawn path would be written into. (The
#: engine is reused across examples, so this drives the [cache] flags' checking, not the
#: tier itself; tests/cache covers that.)
CACHE_DIR = str(Path(tempfile.gettempdir()) / "foretell-fuzz-cache")


ints = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**64 - 1, 2**64, 10**30])
).map(str)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "-0.0", "1", "0.5"]),
)
texts = st.one_of(
    st.text(max_size=12),
    st.binary(max_size=12).map(os.fsdecode),
    st.sampled_from(["-", "", "\\n", "\\t", "/etc", "-x", "demo"]),
).map(lambda t: t.replace("\x00", ""))  # argv is C strings: a NUL cannot reach us
drafts = st.one_of(st.sampled_from(["none", "auto", "ngram", "two-model", "mtp"]), texts)
VALUES = {"int": ints, "float": floats, "text": texts, "draft": drafts}


@st.composite
def run_argv(draw) -> list[str]:
    argv = []
    for flag in draw(st.lists(st.sampled_from(sorted(RUN_FLAGS)), max_size=5)):
        value = draw(st.one_of(VALUES[RUN_FLAGS[flag]], texts))  # sometimes the wrong type
        argv += [flag, value]
    argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=2))
    return argv + (["--cache-dir", CACHE_DIR] if draw(st.booleans()) else [])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from foretell.tools import make_model_dir

    path = make_model_dir(tmp_path_factory.mktemp("fuzz") / "qwen3", "qwen3")
    return path, foretell.load(path)


@pytest.fixture
def capped_engine(tiny, monkeypatch):
    path, engine = tiny
    real = foretell.Engine.generate

    def capped(self, prompt, **options):
        options["max_tokens"] = min(options.get("max_tokens", 256), 3)
        return real(self, prompt, **options)

    monkeypatch.setattr(foretell.Engine, "generate", capped)
    def reopen(model, registry, quiet, **options):
        engine.use_draft(None)  # what an earlier example chose must not leak into this one
        return engine

    monkeypatch.setattr(run_cmd, "open_engine", reopen)
    return path


def outcome(argv: list[str], stdin: bytes, capsys) -> tuple[int, str]:
    import sys

    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    finally:
        sys.stdin = sys.__stdin__
    return code, capsys.readouterr().err


def assert_clean(code, err: str) -> None:
    assert "Traceback" not in err
    assert code in (0, 1, 2), err
    if code:
        problems = [line for line in err.splitlines() if "error:" in line]
        assert len(problems) == 1 and problems[0].startswith("foretell"), err


FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(argv=run_argv(), stdin=st.binary(max_size=16))
def test_run_never_shows_a_traceback(argv, stdin, capped_engine, capsys):
    argv = ["run", *argv] if "--model" in argv else ["run", "--model", str(capped_engine), *argv]
    assert_clean(*outcome(argv, stdin, capsys))


@FUZZ
@given(
    argv=run_argv().map(lambda a: [x for x in a if x not in ("--prompt", "--stop", "--chat",
                                                              "--no-chat", "--json")]),
    stdin=st.lists(st.one_of(st.binary(max_size=10), st.sampled_from(
        [b"/help", b"/reset", b"/bogus", b" /x y", b"hi"])), max_size=4),
    system=st.one_of(st.none(), texts),
)
def test_chat_never_shows_a_traceback(argv, stdin, system, capped_engine, capsys):
    argv = ["chat", *argv] if "--model" in argv else ["chat", "--model", str(capped_engine), *argv]
    argv += [] if system is None else ["--system", system]
    assert_clean(*outcome(argv, b"\n".join(stdin) + b"\n", capsys))


@FUZZ
@given(argv=st.lists(st.one_of(texts, st.sampled_from(["--json", "--bogus", "-h"])), max_size=3))
def test_plugins_never_shows_a_traceback(argv, capsys):
    code, err = outcome(["plugins", *[a for a in argv if a not in ("-h", "--help")]], b"", capsys)
    assert_clean(code, err)


CACHE_FLAGS = {"--model": "text", "--kv-bits": "int", "--layout": "text", "--max-gb": "float",
               "--older-than": "float"}


@pytest.fixture(scope="module")
def stored_cache(tiny, tmp_path_factory):
    """A cache directory holding an entry of the tiny model (each example works on a copy:
    gc and clear delete)."""
    path, _ = tiny
    cache = tmp_path_factory.mktemp("fuzz-cache")
    argv = ["run", "--model", str(path), "--cache-dir", str(cache), "--max-tokens", "2",
            "--draft", "none", "--json"]
    assert main(argv) == 0
    assert any(cache.rglob("*.safetensors"))
    return cache


@settings(FUZZ, max_examples=100)
@given(
    action=st.sampled_from(["ls", "stats", "verify", "gc", "clear"]),
    flags=st.lists(st.sampled_from(sorted(CACHE_FLAGS)), max_size=3, unique=True),
    values=st.data(),
    as_json=st.booleans(),
)
def test_cache_never_shows_a_traceback(action, flags, values, as_json, stored_cache, tiny,
                                       tmp_path_factory, capsys):
    import shutil

    cache = shutil.copytree(stored_cache, tmp_path_factory.mktemp("copy") / "cache")
    argv = ["cache", action, "--cache-dir", str(cache)]
    for flag in flags:
        right = st.just(str(tiny[0])) if flag == "--model" else VALUES[CACHE_FLAGS[flag]]
        argv += [flag, values.draw(st.one_of(right, right, texts))]  # mostly the right type
    assert_clean(*outcome(argv + ["--json"] * as_json, b"", capsys))


@pytest.mark.parametrize("flag", ["--max-gb", "--older-than"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "x"])
def test_cache_gc_refuses_a_limit_that_is_not_a_number(flag, value, stored_cache, tmp_path,
                                                       capsys):
    import shutil

    cache = shutil.copytree(stored_cache, tmp_path / "cache")
    code, err = outcome(["cache", "gc", "--cache-dir", str(cache), flag, value], b"", capsys)
    assert code == 2 and f"argument {flag}: expected a" in err and "Traceback" not in err
    assert any(cache.rglob("*.safetensors")), "a refused limit evicts nothing"


def test_cache_with_a_model_directory_that_has_no_config_names_the_file(stored_cache, tmp_path,
                                                                         capsys):
    code, err = outcome(["cache", "ls", "--cache-dir", str(stored_cache), "--model",
                         str(tmp_path)], b"", capsys)
    assert code == 1 and f"{tmp_path / 'config.json'}: No such file or directory" in err
