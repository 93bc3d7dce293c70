"""Tool calls in the model's own format: prompts that offer tools, and calls parsed out of
replies, whole or as they stream.

The format is Hermes/Qwen's: a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` in the reply, and results go back as ``tool`` messages. A chat template that
renders tools itself in this format (Qwen2.5, Qwen3, Hermes) is given them as Hugging Face
templates take them (``tools=``, ``tool_calls`` with ``arguments`` as an object); for any
other template the server writes the same instructions into the system message, renders
past calls and results as text in the same format, and parses replies the same way
(docs/decisions.md, "Tool calls").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from foretell.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_PROBE = "zz_foretell_probe"

SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@attrs.frozen
class Tool:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None

    def for_template(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        function["parameters"] = dict(self.parameters or {"type": "object", "properties": {}})
        return {"type": "function", "function": function}


@attrs.frozen
class ToolCall:
    name: str
    #: The arguments as a JSON text (what OpenAI's API carries).
    arguments: str
    id: str = attrs.field(factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def input(self) -> Any:
        """The arguments as a value (what Anthropic's API carries)."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}


@attrs.frozen
class TemplateSupport:
    """What a chat template renders itself: offered tools in this format, assistant
    messages' ``tool_calls``, and ``tool`` messages."""

    tools: bool
    calls: bool
    results: bool

    @classmethod
    def probe(cls, tokenizer: Tokenizer) -> TemplateSupport:
        def renders(messages: list[dict[str, Any]], marker: str, **extra: Any) -> bool:
            try:
                return marker in tokenizer.apply_chat_template(messages, **extra)
            except Exception:  # noqa: BLE001 - a template that refuses the shape lacks it
                return False

        user = [{"role": "user", "content": "hi"}]
        probe_tool = Tool(_PROBE).for_template()
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "id": "c",
                                "function": {"name": _PROBE, "arguments": {}}}]}
        result = {"role": "tool", "content": _PROBE + "_result", "tool_call_id": "c"}
        return cls(tools=renders(user, OPEN, tools=[probe_tool])
                   and renders(user, _PROBE, tools=[probe_tool]),
                   calls=renders([*user, call, *user], _PROBE),
                   results=renders([*user, call, result], _PROBE + "_result"))


def render(tokenizer: Tokenizer, support: TemplateSupport, messages: Sequence[dict[str, Any]],
           tools: Sequence[Tool]) -> str:
    """The prompt for ``messages`` (OpenAI's chat shape, ``tool_calls`` arguments as
    objects), offering ``tools``; what the template cannot render is written as text."""
    messages = [_as_text(m, support) for m in messages]
    extra: dict[str, Any] = {}
    if tools and support.tools:
        extra["tools"] = [t.for_template() for t in tools]
    elif tools:
        listing = "\n".join(json.dumps(t.for_template(), ensure_ascii=False) for t in tools)
        instructions = SYSTEM_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            messages[0] = {**first, "content": f"{first['content']}\n\n{instructions}"}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)


def _as_text(message: dict[str, Any], support: TemplateSupport) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if calls and not support.calls:
        text = "\n".join(f"{OPEN}\n{json.dumps(c['function'], ensure_ascii=False)}\n{CLOSE}"
                         for c in calls)
        content = message.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{text}" if content else text}
    if message["role"] == "tool" and not support.results:
        return {"role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


class ToolCallParser:
    """Splits a reply into content and tool calls as it streams: content is passed on as it
    comes, except text that may be the start of a call; each call when it closes."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content to pass on, calls completed)`` after ``text``."""
        self._buffer += text
        content, calls = "", []
        while True:
            if not self._in_call:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, OPEN)
                    cut = len(self._buffer) - keep
                    content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    break
                content += self._buffer[:at]
                self._buffer = self._buffer[at + len(OPEN):]
                self._in_call = True
            at = self._buffer.find(CLOSE)
            if at < 0:
                break
            body, self._buffer = self._buffer[:at], self._buffer[at + len(CLOSE):]
            self._in_call = False
            call = parse_call(body)
            if call is None:
                content += f"{OPEN}{body}{CLOSE}"
            else:
                calls.append(call)
        self.calls += calls
        return content, calls

    def close(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: what was held back (a call cut off at its end is parsed)."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        call = parse_call(rest)
        if call is None:
            return OPEN + rest, []
        self.calls.append(call)
        return "", [call]


def parse_call(body: str) -> ToolCall | None:
    """A call's JSON (``{"name", "arguments"}``; some models write ``parameters``)."""
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], arguments)


def split_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: its content (stripped) and its calls."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    rest, _ = parser.close()
    return (content + rest).strip(), parser.calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
