"""Live servers for the serve tests: ``foretell serve`` started as a user starts it, in a
process of its own on a free localhost port, with a tiny random Qwen3 model whose chat
template renders tools the way Qwen's does (or the shipped demo, where a real tokenizer
matters), and stopped with SIGTERM at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_helpers import Server

from foretell.tools import make_model_dir

API_KEY = "test-key-123"
#: A Qwen3-like chat template, condensed: tools in the system message, calls as
#: <tool_call> blocks, results as <tool_response> in a user turn.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: Small enough to prefill in a blink on two cores; a short context so "too long" is cheap.
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "max_position_embeddings": 2048}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    path = make_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", overrides=TINY,
                          seed=0)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = QWEN_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The tiny model served with an API key (most tests share it)."""
    live = Server("--model", str(tiny_model), "--api-key", API_KEY, "--max-tokens", "32",
                  cwd=tmp_path_factory.mktemp("cwd"))
    yield live
    live.stop()


@pytest.fixture
def api_key():
    """The key the shared server requires."""
    return API_KEY


@pytest.fixture
def model_id(tiny_model):
    """The id the tiny model is served under (its directory's name)."""
    return tiny_model.name


@pytest.fixture
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The shipped demo model (a real tokenizer), no API key."""
    live = Server("--model", "demo", cwd=tmp_path_factory.mktemp("cwd"))
    yield live
    live.stop()


@pytest.fixture
def demo_client(demo_server):
    import openai

    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0)
