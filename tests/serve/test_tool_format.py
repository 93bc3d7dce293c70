"""Tool calls in the model's own format, without a server: replies split into content and
calls whole or however they stream, and a chat template that knows nothing of tools still
gets them offered, its past calls and results rendered, in the same format."""

from __future__ import annotations

import json

import pytest

from foretell.serve.tools import TemplateSupport, Tool, ToolCallParser, render, split_calls
from foretell.tokenizer import Tokenizer
from foretell.tools import make_model_dir

REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_a_reply_splits_into_its_content_and_its_calls():
    content, calls = split_calls(REPLY)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_in_any_pieces_the_split_is_the_same(size):
    parser = ToolCallParser()
    content, calls = "", []
    for at in range(0, len(REPLY), size):
        text, new = parser.feed(REPLY[at : at + size])
        assert "<" not in text  # no piece of a call's markup is passed on as content
        content += text
        calls += new
    rest, new = parser.close()
    assert (content + rest).strip() == "Let me check."
    assert [c.name for c in calls + new] == ["get_weather", "get_time"]


def test_text_that_only_looks_like_a_call_stays_content():
    content, calls = split_calls("a <tool_call>not json</tool_call> b <tool")
    assert calls == [] and content == "a <tool_call>not json</tool_call> b <tool"


def test_a_call_cut_off_before_its_closing_tag_is_still_a_call():
    _, calls = split_calls('<tool_call>\n{"name": "f", "parameters": {"x": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """A ChatML template that renders any role's content and nothing else."""
    path = make_model_dir(tmp_path_factory.mktemp("plain"), "qwen3", seed=0, overrides={
        "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64})
    return Tokenizer.from_dir(path)


def test_a_template_without_tools_gets_them_offered_and_past_calls_as_text(plain_tokenizer):
    # It renders a "tool" message as it renders any role; tools and calls it drops.
    assert TemplateSupport.probe(plain_tokenizer) == TemplateSupport(
        tools=False, calls=False, results=True)
    support = TemplateSupport(tools=False, calls=False, results=False)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "c1",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"},
    ]
    prompt = render(plain_tokenizer, support, messages, [Tool("get_weather", "The weather")])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather", "description": "The weather"' in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>') in prompt
    assert "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them_as_hugging_face_passes_them(tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    support = TemplateSupport.probe(tokenizer)
    assert support == TemplateSupport(tools=True, calls=True, results=True)
    prompt = render(tokenizer, support, [{"role": "user", "content": "Hi"}],
                    [Tool("f", "", {"type": "object"})])
    assert '{"type": "function", "function": {"name": "f"' in prompt
    assert "# Tools" in prompt and prompt.count("# Tools") == 1
