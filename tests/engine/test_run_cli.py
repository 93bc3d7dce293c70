import io
import json

import pytest

import foretell
from foretell.cli import main

STATS_KEYS = {
    "prompt_tokens",
    "generated_tokens",
    "cached_tokens",
    "ttft_s",
    "prompt_tps",
    "generation_tps",
    "peak_memory_gb",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from foretell.tools import make_model_dir

    return make_model_dir(
        tmp_path_factory.mktemp("cli") / "qwen3", "qwen3", overrides={"tie_word_embeddings": False}
    )


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_run_json_prints_text_events_then_stats(model_dir, capsys):
    assert (
        main(
            [
                "run",
                "--model",
                str(model_dir),
                "--prompt",
                "def f(x):",
                "--max-tokens",
                "6",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    *texts, stats = json_lines(out)
    assert all(e["type"] == "text" and isinstance(e["text"], str) for e in texts)
    assert stats["type"] == "stats" and STATS_KEYS <= set(stats)
    assert stats["generated_tokens"] == sum(len(e["tokens"]) for e in texts) == 6
    assert stats["cached_tokens"] == 0


def test_run_streams_the_same_text_as_the_api_and_reports_speed_on_stderr(model_dir, capsys):
    assert (
        main(["run", "--model", str(model_dir), "--prompt", "def f(x):", "--max-tokens", "6"]) == 0
    )
    captured = capsys.readouterr()
    expected = foretell.load(model_dir).generate_text("def f(x):", max_tokens=6, chat=False)
    assert captured.out == expected + "\n"
    for label in ("Prompt:", "Generation:", "TTFT:", "Peak memory:"):
        assert label in captured.err


def test_the_prompt_may_be_the_argument(model_dir, capsys):
    assert main(["run", "--model", str(model_dir), "def f(x):", "--max-tokens", "6"]) == 0
    expected = foretell.load(model_dir).generate_text("def f(x):", max_tokens=6, chat=False)
    assert capsys.readouterr().out == expected + "\n"


def test_a_prompt_given_twice_is_refused_naming_both(model_dir, capsys):
    assert main(["run", "--model", str(model_dir), "one", "--prompt", "two"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "prompt: given twice" in err and "'one'" in err and "'two'" in err


def test_prompt_dash_reads_stdin(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("class Cache:"))
    assert (
        main(
            [
                "run",
                "--model",
                str(model_dir),
                "--prompt",
                "-",
                "--no-chat",
                "--max-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    stats = json_lines(capsys.readouterr().out)[-1]
    engine = foretell.load(model_dir)
    assert stats["prompt_tokens"] == len(engine.encode_prompt("class Cache:", chat=False))


def test_flags_override_the_config_file(model_dir, capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{model_dir}"\nmax_tokens = 9\n[sampling]\ntemp = 0.0\n')
    assert main(["run", "--config", str(config), "--max-tokens", "4", "--json"]) == 0
    assert json_lines(capsys.readouterr().out)[-1]["generated_tokens"] == 4


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--temp", "hot"], 2, "argument --temp: invalid float value: 'hot'"),
        (["--max-tokens", "1.5"], 2, "argument --max-tokens: invalid int value"),
        (["--temp", "-1"], 1, "sampling.temp: must be >= 0.0, got -1.0 (set by --temp)"),
        (["--top-p", "1.5"], 1, "sampling.top_p: must be <= 1.0, got 1.5 (set by --top-p)"),
        (["--max-tokens", "0"], 1, "max_tokens: must be >= 1, got 0 (set by --max-tokens)"),
        (
            ["--model", "no-such-model"],
            1,
            "--model no-such-model: no such directory and no shipped model",
        ),
    ],
)
def test_bad_flag_values_exit_non_zero_with_one_line(argv, code, says, model_dir, capsys):
    if "--model" not in argv:
        argv = [*argv, "--model", str(model_dir)]
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(["run", "--prompt", "x", *argv]))
    err = capsys.readouterr().err
    assert exited.value.code == code
    assert len(err.strip().splitlines()) == 1 and says in err


def test_chat_without_a_template_is_refused(model_dir, capsys, tmp_path):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in model_dir.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["run", "--model", str(plain), "--chat", "--prompt", "x"]) == 1
    assert "no chat template" in capsys.readouterr().err


def test_chat_keeps_history_and_resets(model_dir, capsys, monkeypatch):
    seen = []
    real_generate = foretell.Engine.generate

    def spy(self, prompt, **options):
        seen.append([dict(m) for m in prompt])
        return real_generate(self, prompt, **options)

    monkeypatch.setattr(foretell.Engine, "generate", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n/reset\nfresh\n"))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "3"]) == 0
    assert [[m["role"] for m in turn] for turn in seen] == [
        ["user"],
        ["user", "assistant", "user"],
        ["user"],
    ]
    assert seen[1][2]["content"] == "again" and seen[2][0]["content"] == "fresh"
    first_reply = seen[1][1]["content"]
    assert capsys.readouterr().out.startswith(first_reply + "\n")


def test_chat_exits_on_the_exit_command(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\nnever read\n"))
    assert main(["chat", "--model", str(model_dir)]) == 0
    assert capsys.readouterr().out == ""


def test_chat_reports_a_refused_turn_and_carries_on(model_dir, tmp_path, capsys, monkeypatch):
    picky = tmp_path / "picky"
    picky.mkdir()
    for f in model_dir.iterdir():
        (picky / f.name).write_bytes(f.read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    refusal = "{% if messages[-1].content == 'boom' %}{{ raise_exception('no booms') }}{% endif %}"
    config["chat_template"] = refusal + config["chat_template"]
    (picky / "tokenizer_config.json").write_text(json.dumps(config))
    sent = []
    real = foretell.Engine.generate

    def spy(self, prompt, **options):
        sent.append([dict(m) for m in prompt])  # the history grows after the call
        return real(self, prompt, **options)

    monkeypatch.setattr(foretell.Engine, "generate", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("boom\nfine\n"))
    assert main(["chat", "--model", str(picky), "--max-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("foretell: error:") == 1 and "no booms" in captured.err
    # the refused turn is dropped from the conversation; the next one is answered
    assert sent[-1] == [{"role": "user", "content": "fine"}]
    assert captured.err.count(" tokens, ") == 1 and captured.out.endswith("\n")


def test_chat_speculates_with_the_drafter_it_is_given(model_dir, capsys, monkeypatch,
                                                    ngram_installed):
    """`foretell chat` takes `run`'s drafter flags and uses them: each turn's note names the
    drafter, and greedy replies are the ones plain decoding gives."""
    replies = {}
    for draft in ("none", "ngram"):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello hello hello\nagain\n"))
        options = ["--draft-option", "min_ngram=1"] if draft == "ngram" else []
        assert main(["chat", "--model", str(model_dir), "--max-tokens", "12", "--temp", "0",
                     "--draft", draft, *options]) == 0
        captured = capsys.readouterr()
        replies[draft] = captured.out
        notes = [line for line in captured.err.splitlines() if "tok/s" in line]
        assert len(notes) == 2
        assert all(("drafter ngram, " in n) == (draft == "ngram") for n in notes), notes
    assert replies["ngram"] == replies["none"] and replies["none"].count("\n") == 2


def test_run_reports_what_the_drafter_did(model_dir, capsys, ngram_installed):
    assert main(["run", "--model", str(model_dir), "--prompt", "a b a b a b", "--max-tokens", "8",
                 "--draft", "ngram", "--draft-option", "min_ngram=1", "--no-chat"]) == 0
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("Speculation: ")]
    assert len(line) == 1 and line[0].startswith("Speculation: ngram, ")
    assert "drafts accepted" in line[0] and "tokens per target forward" in line[0]


def test_the_report_gives_the_prompt_speed_of_the_tokens_computed(capsys):
    """A resumed run's checkpoint covers its whole prompt: no prompt speed to report; a
    partly cached prompt's speed names the tokens it is over."""
    from foretell.cli.run_cmd import report
    from foretell.stream import Stats

    common = dict(generated_tokens=9, ttft_s=0.01, generation_tps=90.0, peak_memory_gb=0.1,
                  finish_reason="length")
    report(Stats(prompt_tokens=6, cached_tokens=6, prompt_tps=0.0, **common,
                           cached_from="checkpoint"))
    assert "Prompt: 6 tokens, none computed (all from the checkpoint)" in capsys.readouterr().err
    report(Stats(prompt_tokens=6, cached_tokens=5, prompt_tps=100.0, **common,
                           cached_from="ssd"))
    assert "Prompt: 6 tokens, 100.000 tokens-per-sec over the 1 computed" in (
        capsys.readouterr().err)
    report(Stats(prompt_tokens=6, cached_tokens=0, prompt_tps=100.0, **common))
    assert "Prompt: 6 tokens, 100.000 tokens-per-sec\n" in capsys.readouterr().err
