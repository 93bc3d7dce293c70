"""Anthropic's API: ``POST /v1/messages`` (streamed as its events, or whole) and
``POST /v1/messages/count_tokens``.

Content blocks of type ``text``, ``tool_use`` and ``tool_result`` are read; others (images,
documents, thinking) are a 400 naming the block. ``usage.input_tokens`` counts the prompt
tokens computed for this request and ``cache_read_input_tokens`` those served from the
prefix cache (their sum is the prompt), as Anthropic reports prompt caching.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from foretell.serve.errors import APIError, bad_request
from foretell.serve.fields import field, model_name, number, refuse_unknown, stop_strings
from foretell.serve.generation import EXTENSION, Backend, Job, Reply, stop_matched
from foretell.serve.grammar import tool_call_grammar
from foretell.serve.tools import CLOSE, OPEN, Tool, ToolCall, ToolCallParser, split_calls

MESSAGES_FIELDS = ("model", "messages", "system", "max_tokens", "stop_sequences", "stream",
                   "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata",
                   EXTENSION)
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice")
STOP = {"eos": "end_turn", "length": "max_tokens"}


def conversation(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat templates take them (OpenAI's shape)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _blocks_text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        refuse_unknown(message, ("role", "content"), where)
        role = field(message, "role", str, where=where, required=True)
        if role not in ("user", "assistant"):
            raise bad_request(f"'{where}.role' must be 'user' or 'assistant', got {role!r}",
                              param=f"{where}.role")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"'{where}.content' must be a string or an array of content "
                              "blocks", param=f"{where}.content")
        out += _message(role, blocks, f"{where}.content")
    return out


def _message(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(field(block, "text", str, where=at, required=True))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"type": "function", "id": field(block, "id", str, where=at),
                          "function": {"name": field(block, "name", str, where=at,
                                                     required=True),
                                       "arguments": field(block, "input", dict, where=at,
                                                          default={})}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "content": _blocks_text(block.get("content") or "",
                                                                    f"{at}.content"),
                            "tool_call_id": field(block, "tool_use_id", str, where=at,
                                                  default="")})
        else:
            raise bad_request(f"'{at}': a {role} message's block of type {kind!r} is not "
                              "supported here (text, tool_use from the assistant, tool_result "
                              "from the user)", param=at)
    out = list(results)
    if texts or calls or not results:
        item: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            item["tool_calls"] = calls
        out.append(item)
    return out


def _blocks_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        return "".join(b["text"] for b in value)
    raise bad_request(f"'{where}' must be a string or an array of text blocks", param=where)


def tools_of(body: Mapping[str, Any]) -> tuple[list[Tool], str | None]:
    """The tools offered and the choice: None (auto), ``"none"``, ``"required"`` or a name."""
    tools = []
    for i, tool in enumerate(field(body, "tools", list, default=[])):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"'{where}' must be {{'name', 'description', 'input_schema'}}",
                              param=where)
        tools.append(Tool(tool["name"], tool.get("description") or "",
                          field(tool, "input_schema", dict, where=where)))
    choice = field(body, "tool_choice", dict, default={"type": "auto"})
    kind = choice.get("type")
    if kind == "auto":
        return tools, None
    if kind == "none":
        return tools, "none"
    if kind == "any":
        return tools, "required"
    if kind == "tool":
        name = field(choice, "name", str, where="tool_choice", required=True)
        if name not in {t.name for t in tools}:
            raise bad_request(f"'tool_choice.name' {name!r} is not among 'tools'",
                              param="tool_choice.name")
        return tools, name
    raise bad_request("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'",
                      param="tool_choice.type")


def _prompt(backend: Backend, body: Mapping[str, Any]) -> tuple[list[int], bool, Any]:
    """The prompt's ids, whether to parse tool calls out of the reply, and the grammar a
    forced ``tool_choice`` imposes. ``none`` still offers the tools (the prompt, and so the
    cached prefix, stays the same across an agent's turns)."""
    tools, choice = tools_of(body)
    ids = backend.chat_ids(conversation(body), tools)
    grammar = None
    if choice not in (None, "none"):
        if not tools:
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        forced = tools if choice == "required" else [t for t in tools if t.name == choice]
        grammar = tool_call_grammar(backend.grammars, [
            {"name": t.name, "parameters": t.parameters} for t in forced], OPEN, CLOSE, "tools")
    return ids, bool(tools) and choice != "none", grammar


async def count_tokens(backend: Backend, body: dict[str, Any], receive: Any) -> Response:
    refuse_unknown(body, COUNT_FIELDS)
    model_name(body, backend.served)
    ids, _, _ = _prompt(backend, body)
    return JSONResponse({"input_tokens": len(ids)})


async def messages(backend: Backend, body: dict[str, Any], receive: Any) -> Response:
    refuse_unknown(body, MESSAGES_FIELDS)
    model = model_name(body, backend.served)
    ids, parse, grammar = _prompt(backend, body)
    requested = number(body, "max_tokens", lo=-2**31, hi=2**31, integer=True)
    if requested is None:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    extension = backend.extension(body)
    stops = tuple(stop_strings(body, "stop_sequences"))
    job = Job(
        ids=ids, max_tokens=backend.budget(ids, requested, "max_tokens"),
        sampling=backend.sampling(
            temp=number(body, "temperature", lo=0, hi=1),
            top_p=number(body, "top_p", lo=1e-9, hi=1),
            top_k=number(body, "top_k", lo=0, hi=2**31 - 1, integer=True) or extension["top_k"],
            min_p=extension["min_p"], repetition_penalty=extension["repetition_penalty"]),
        stop=backend.stops(stops), grammar=grammar, speculate=await backend.speculate(extension["draft"]),
        ignore_eos=extension["ignore_eos"])
    stream = field(body, "stream", bool, default=False)
    handle = await backend.start(job)
    message_id = "msg_" + uuid.uuid4().hex
    if stream:
        return StreamingResponse(_stream(backend, handle, message_id, model, parse,
                                         stops), media_type="text/event-stream")
    reply = await backend.collect(handle, receive)
    text, calls = split_calls(reply.text) if parse else (reply.text, [])
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
    content += [_tool_use(c) for c in calls]
    reason, sequence = _stop(backend, reply, calls, stops)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant",
                         "model": model, "content": content, "stop_reason": reason,
                         "stop_sequence": sequence, "usage": _usage(reply.stats, len(ids))})


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.input()}


def _stop(backend: Backend, reply: Reply, calls: list[ToolCall],
          stops: tuple[str, ...]) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    reason = reply.stats.finish_reason if reply.stats else "eos"
    if reason == "stop":
        matched = stop_matched(backend.engine.tokenizer, reply.text, reply.tokens, stops)
        return ("stop_sequence", matched) if matched else ("end_turn", None)
    return STOP.get(reason, "end_turn"), None


def _usage(stats: Any, prompt_tokens: int) -> dict[str, Any]:
    cached = stats.cached_tokens if stats else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens":
            stats.generated_tokens if stats else 0, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def _stream(backend: Backend, handle: Any, message_id: str, model: str, parse: bool,
                  stops: tuple[str, ...]) -> AsyncIterator[str]:
    prompt_tokens = handle.prompt_tokens
    yield event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": _usage(None, prompt_tokens)}})
    parser = ToolCallParser() if parse else None
    reply, texts, blocks = Reply(), [], _Blocks()
    def text_chunks(item: Any) -> list[str]:
        texts.append(item.text)
        reply.tokens += item.tokens
        content, calls = parser.feed(item.text) if parser else (item.text, [])
        return blocks.text(content) + blocks.tool_uses(calls)

    try:
        async for piece in backend.writes(handle, reply, text_chunks):
            yield piece
        end = []
        if parser:
            content, calls = parser.close()
            end += blocks.text(content) + blocks.tool_uses(calls)
    except APIError as exc:
        yield f"event: error\ndata: {json.dumps(exc.anthropic_body())}\n\n"
        return
    end += blocks.close()
    reply.text = "".join(texts)
    reason, sequence = _stop(backend, reply, parser.calls if parser else [], stops)
    end.append(event("message_delta", {"delta": {"stop_reason": reason,
                                                 "stop_sequence": sequence},
                                       "usage": _usage(reply.stats, prompt_tokens)}))
    yield "".join(end) + event("message_stop", {})


class _Blocks:
    """A streamed reply's content blocks: a text block opened at the first text after any
    tool call, one ``tool_use`` block per call (its input in one ``input_json_delta``)."""

    def __init__(self) -> None:
        self.count = 0
        self.text_open = False

    def text(self, content: str) -> list[str]:
        if not content:
            return []
        out = []
        if not self.text_open:
            out.append(event("content_block_start", {"index": self.count, "content_block":
                                                     {"type": "text", "text": ""}}))
            self.count, self.text_open = self.count + 1, True
        out.append(event("content_block_delta", {"index": self.count - 1, "delta":
                                                 {"type": "text_delta", "text": content}}))
        return out

    def tool_uses(self, calls: list[ToolCall]) -> list[str]:
        out = self.close() if calls else []
        for call in calls:
            use = _tool_use(call)
            out.append(event("content_block_start", {"index": self.count, "content_block":
                                                     {**use, "input": {}}}))
            out.append(event("content_block_delta", {"index": self.count, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(use["input"])}}))
            out.append(event("content_block_stop", {"index": self.count}))
            self.count += 1
        return out

    def close(self) -> list[str]:
        """End the open text block, if any."""
        if not self.text_open:
            return []
        self.text_open = False
        return [event("content_block_stop", {"index": self.count - 1})]
