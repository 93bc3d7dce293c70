"""``foretell run`` starts the draft-length policy from what the previous run of the same
model, drafter and device stored, and stores what it learned; ``--no-policy-memory`` does
neither; an unusable file costs nothing but the memory."""

from __future__ import annotations

import json

import pytest

from foretell.cli import main
from foretell.spec.policy import STATE_TIMINGS
from foretell.store.entry import model_fingerprint, weights_digest


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "policy"
    monkeypatch.setenv("FORETELL_POLICY_MEMORY_DIR", str(path))
    return path


def _run(model_dir, capsys, *more: str) -> list[dict]:
    """A self-drafting greedy run of 40 tokens; its JSON events."""
    argv = ["run", "--model", str(model_dir), "--draft-model", str(model_dir), "--prompt",
            "def f(x):", "--max-tokens", "40", "--no-model-stops", "--json", *more]
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _tokens(events: list[dict]) -> list[int]:
    return [t for e in events if e["type"] == "text" for t in e["tokens"]]


def _files(root):
    return sorted(root.iterdir()) if root.exists() else []


def test_run_stores_the_state_under_the_models_fingerprint_and_recalls_it(
        model_dirs, root, capsys):
    model = model_dirs["qwen3"]
    first = _run(model, capsys)
    (path,) = _files(root)
    stored = json.loads(path.read_text())
    config = json.loads((model / "config.json").read_text())
    assert stored["key"]["target"] == model_fingerprint(config, weights_digest(model))
    assert stored["key"]["drafter"]["kind"] == "two-model"
    assert stored["key"]["sampled"] is False and stored["key"]["device"].startswith("cpu:")
    assert stored["state"]["timings"] < STATE_TIMINGS  # one short run's timings
    # A state resting on the most timings: the next run blends what it times into it, and
    # only a run that recalled it keeps that weight.
    stored["state"]["timings"] = STATE_TIMINGS
    path.write_text(json.dumps(stored))
    second = _run(model, capsys)
    assert json.loads(path.read_text())["state"]["timings"] == STATE_TIMINGS
    # Greedy output does not depend on how many tokens were drafted.
    assert _tokens(first) == _tokens(second)


def test_no_policy_memory_neither_recalls_nor_stores(model_dirs, root, capsys):
    _run(model_dirs["qwen3"], capsys, "--no-policy-memory")
    assert _files(root) == []


def test_sampled_and_greedy_runs_keep_apart(model_dirs, root, capsys):
    _run(model_dirs["qwen3"], capsys)
    _run(model_dirs["qwen3"], capsys, "--temp", "1", "--seed", "3")
    keys = [json.loads(p.read_text())["key"]["sampled"] for p in _files(root)]
    assert sorted(keys) == [False, True]


@pytest.mark.parametrize("content", [b"{not json", b"\xff" * 10, b"[]"])
def test_an_unusable_file_does_not_change_the_run_and_is_replaced(
        model_dirs, root, capsys, content):
    plain = _run(model_dirs["qwen3"], capsys, "--no-policy-memory")
    _run(model_dirs["qwen3"], capsys)
    (path,) = _files(root)
    path.write_bytes(content)
    again = _run(model_dirs["qwen3"], capsys)
    assert _tokens(again) == _tokens(plain)
    assert "state" in json.loads(path.read_text())
