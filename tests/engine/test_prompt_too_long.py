"""A prompt longer than the model's context is refused with the numbers, before anything is
allocated (issue 48: a 1 MB prompt was warned about, then killed for memory)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import foretell
from foretell.errors import GenerationError
from foretell.tools import make_model_dir


@pytest.fixture(scope="module")
def small_context(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("ctx") / "qwen3", "qwen3",
                          overrides={"max_position_embeddings": 64})
    return foretell.load(path)


def test_a_prompt_past_the_context_is_refused_with_the_numbers_before_it_runs(small_context):
    mx.reset_peak_memory()
    with pytest.raises(GenerationError) as info:
        small_context.generate(list(range(3, 3 + 65)), max_tokens=4)  # refused at the call
    message = str(info.value)
    assert "a 65-token prompt does not fit the model's 64-token context" in message
    assert str(small_context.path / "config.json") in message
    assert "at most 64 prompt tokens fit" in message
    assert mx.get_peak_memory() == 0  # no cache, no activation


def test_a_prompt_that_fills_the_context_is_served(small_context):
    events = list(small_context.generate(list(range(3, 3 + 64)), max_tokens=2, ignore_eos=True))
    assert events[-1].prompt_tokens == 64 and events[-1].generated_tokens == 2


def test_rope_scaling_extends_the_context_it_is_checked_against(tmp_path):
    path = make_model_dir(tmp_path / "qwen3", "qwen3", overrides={"max_position_embeddings": 64})
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(config))
    engine = foretell.load(path)
    assert engine.context_length == 256
    assert list(engine.generate(list(range(3, 3 + 200)), max_tokens=1))[-1].prompt_tokens == 200


def test_the_shipped_demo_refuses_a_megabyte_prompt():
    engine = foretell.load("demo")
    prompt = "def fibonacci(n):\n    return n\n" * ((1 << 20) // 31)  # 1 MB
    with pytest.raises(GenerationError, match=r"-token prompt does not fit the model's "
                                              r"4,096-token context"):
        engine.generate(prompt, max_tokens=8, chat=False)
