"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Each body is read field by field (:mod:`foretell.serve.fields`): a field this server does not
know is a 400 naming it; one it knows but does not implement (``n`` > 1, penalties) is
accepted only at its neutral value. ``temperature``, ``top_p`` and ``seed`` left out take the
server's defaults (``foretell serve --temp ...``); ``max_tokens`` left out takes the server's
``--max-tokens``, within the model's context.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from foretell.serve.errors import APIError, bad_request
from foretell.serve.fields import (
    field,
    model_name,
    neutral,
    number,
    refuse_unknown,
    stop_strings,
)
from foretell.serve.generation import EXTENSION, Backend, Job, Reply
from foretell.serve.grammar import response_format_grammar, tool_call_grammar
from foretell.serve.tools import CLOSE, OPEN, Tool, ToolCall, ToolCallParser, split_calls

_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "n", "frequency_penalty", "presence_penalty", "logit_bias",
           "user", "metadata", "store", EXTENSION)
CHAT_FIELDS = (*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
               "tools", "tool_choice", "parallel_tool_calls", "response_format")
#: ``response_format`` on completions is vLLM's extension (OpenAI's takes it on chat only).
COMPLETION_FIELDS = (*_COMMON, "prompt", "logprobs", "echo", "best_of", "suffix",
                     "response_format")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                  "annotations", "audio", "function_call")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def models(backend: Backend) -> Response:
    created = int(time.time())
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "foretell"}
        for name in backend.served]})


async def _job(backend: Backend, body: Mapping[str, Any], ids: list[int], max_param: str,
               grammar: str | None, logprobs: int | None) -> Job:
    neutral(body, "n", (1,), "one choice per request")
    neutral(body, "best_of", (1,), "one choice per request")
    for name in ("frequency_penalty", "presence_penalty"):
        neutral(body, name, (0, 0.0), "use foretell.repetition_penalty")
    neutral(body, "logit_bias", ({},), "no logit bias")
    extension = backend.extension(body)
    requested = number(body, max_param, lo=-2**31, hi=2**31, integer=True)
    return Job(
        ids=ids, max_tokens=backend.budget(ids, requested, max_param),
        sampling=backend.sampling(
            temp=number(body, "temperature", lo=0, hi=2),
            top_p=number(body, "top_p", lo=1e-9, hi=1),
            seed=number(body, "seed", lo=0, hi=2**64 - 1, integer=True),
            top_k=extension["top_k"], min_p=extension["min_p"],
            repetition_penalty=extension["repetition_penalty"]),
        stop=backend.stops(stop_strings(body, "stop")), logprobs=logprobs, grammar=grammar,
        speculate=await backend.speculate(extension["draft"]),
        ignore_eos=extension["ignore_eos"])


def _streaming(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = field(body, "stream", bool, default=False)
    options = field(body, "stream_options", dict, default={})
    if options and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true",
                          param="stream_options")
    refuse_unknown(options, ("include_usage", "continuous_usage_stats"), "stream_options")
    return stream, field(options, "include_usage", bool, where="stream_options", default=False)


def usage(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


#: Stands for the text in :func:`sse_text`'s template (a private-use character).
_TEXT = "\ue000"


def sse_text(chunk: Callable[[str], str]) -> Callable[[str], str]:
    """``chunk`` (a text's event, as :func:`sse` writes it) for one stream's chunks, each
    only the text encoded into the rest worked out once: the event loop formats a chunk a
    token, and encoding the whole object each time was a tenth of its time
    (docs/decisions.md)."""
    parts = chunk(_TEXT).split(json.dumps(_TEXT, ensure_ascii=False))
    if len(parts) != 2:  # the character is in the rest too (a model's name)
        return chunk
    head, tail = parts
    return lambda text: head + json.dumps(text, ensure_ascii=False) + tail


# -- chat ----------------------------------------------------------------------------------


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates take them (``tool_calls`` arguments as objects)."""
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        refuse_unknown(message, MESSAGE_FIELDS, where)
        role = field(message, "role", str, where=where, required=True)
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"'{where}.role' {role!r} is not one of system, developer, user, "
                              "assistant, tool", param=f"{where}.role")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": _text(message.get("content"), f"{where}.content")}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]")
                                  for j, c in enumerate(field(message, "tool_calls", list,
                                                              where=where))]
        if role == "tool":
            item["tool_call_id"] = field(message, "tool_call_id", str, where=where, default="")
        out.append(item)
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{j}]': only text parts are supported (got "
                                  f"{kind!r}); this server serves text models", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'{where}' must be a string or an array of text parts", param=where)


def _past_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{'name', "
                          "'arguments'}}}", param=where)
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # templates render a string as it is
    return {"type": "function", "id": call.get("id"),
            "function": {"name": function["name"], "arguments": arguments}}


def chat_tools(body: Mapping[str, Any]) -> tuple[list[Tool], str | None]:
    """The tools offered and the choice: None (auto), ``"none"``, ``"required"`` or a name."""
    tools = []
    for i, tool in enumerate(field(body, "tools", list, default=[])):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{'name', "
                              "'description', 'parameters'}}}", param=where)
        parameters = field(function, "parameters", dict, where=f"{where}.function")
        tools.append(Tool(function["name"], function.get("description") or "", parameters))
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return tools, None
    if choice in ("none", "required"):
        name = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if name not in {t.name for t in tools}:
            raise bad_request(f"'tool_choice' names {name!r}, which 'tools' does not offer",
                              param="tool_choice")
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name != "none" and not tools:
        raise bad_request(f"'tool_choice' {name!r} needs 'tools'", param="tool_choice")
    return tools, name


async def chat_completions(backend: Backend, body: dict[str, Any], receive: Any) -> Response:
    refuse_unknown(body, CHAT_FIELDS)
    model = model_name(body, backend.served)
    messages = chat_messages(body.get("messages"))
    tools, choice = chat_tools(body)
    grammar = response_format_grammar(backend.grammars, body.get("response_format"))
    if choice not in (None, "none"):
        if grammar is not None:
            raise bad_request("'response_format' and a forced 'tool_choice' cannot both shape "
                              "the reply", param="response_format")
        forced = tools if choice == "required" else [t for t in tools if t.name == choice]
        grammar = tool_call_grammar(backend.grammars, [
            {"name": t.name, "parameters": t.parameters} for t in forced], OPEN, CLOSE,
            "tools")
    logprobs = None
    if field(body, "logprobs", bool, default=False):
        logprobs = number(body, "top_logprobs", lo=0, hi=20, integer=True, default=0)
    elif body.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    field(body, "parallel_tool_calls", bool)
    stream, include_usage = _streaming(body)
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    ids = backend.chat_ids(messages, tools)
    job = await _job(backend, body, ids, max_param, grammar, logprobs)
    handle = await backend.start(job)
    reply_id = "chatcmpl-" + uuid.uuid4().hex
    # "none" still offers the tools (the prompt, and so the cached prefix, stays the same
    # across an agent's turns) but leaves any call the model writes as text.
    parse = bool(tools) and choice != "none"
    if stream:
        return StreamingResponse(_chat_stream(backend, handle, reply_id, model, parse,
                                              include_usage, logprobs is not None),
                                 media_type="text/event-stream")
    reply = await backend.collect(handle, receive)
    content, calls = split_calls(reply.text) if parse else (reply.text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content or None, "refusal": None}
    if calls:
        message["tool_calls"] = [_call(c) for c in calls]
    return JSONResponse({
        "id": reply_id, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply, calls),
                     "logprobs": {"content": _chat_logprobs(backend, reply.logprobs),
                                  "refusal": None} if logprobs is not None else None}],
        "usage": usage(reply.stats)})


def _finish(reply: Reply, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_calls"
    return FINISH.get(reply.stats.finish_reason, "stop") if reply.stats else "stop"


def _call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _token(backend: Backend, token: int, logprob: float) -> dict[str, Any]:
    text = backend.engine.tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(backend: Backend, entries: list[Any]) -> list[dict[str, Any]]:
    return [{**_token(backend, e.token, e.logprob),
             "top_logprobs": [_token(backend, t, lp) for t, lp in e.top]} for e in entries]


async def _chat_stream(backend: Backend, handle: Any, reply_id: str, model: str, parse: bool,
                       include_usage: bool, logprobs: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": {"content": lps, "refusal": None} if lps is not None else None}
        return sse({"id": reply_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    parser = ToolCallParser() if parse else None
    calls: list[ToolCall] = []
    reply = Reply()

    content_chunk = sse_text(lambda text: chunk({"content": text}))

    def content_chunks(content: str, new: list[ToolCall], lps: Any = None) -> list[str]:
        out = [chunk({"content": content}, lps=lps) if lps else content_chunk(content)] \
            if content or lps else []
        for call in new:
            out.append(chunk({"tool_calls": [_call(call, len(calls))]}))
            calls.append(call)
        return out

    def text_chunks(event: Any) -> list[str]:
        lps = _chat_logprobs(backend, list(event.logprobs)) if logprobs else None
        return content_chunks(*(parser.feed(event.text) if parser else (event.text, [])),
                              lps=lps)

    try:
        async for piece in backend.writes(handle, reply, text_chunks):
            yield piece
        end = content_chunks(*parser.close()) if parser else []
    except APIError as exc:
        yield sse(exc.openai_body()) + "data: [DONE]\n\n"
        return
    end.append(chunk({}, _finish(reply, calls)))
    if include_usage:
        end.append(sse({"id": reply_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": usage(reply.stats)}))
    yield "".join(end) + "data: [DONE]\n\n"


# -- completions ---------------------------------------------------------------------------


async def completions(backend: Backend, body: dict[str, Any], receive: Any) -> Response:
    refuse_unknown(body, COMPLETION_FIELDS)
    model = model_name(body, backend.served)
    neutral(body, "echo", (False,), "the reply never repeats the prompt")
    neutral(body, "suffix", ("",), "no fill-in-the-middle")
    if "prompt" not in body:
        raise bad_request("'prompt' is required", param="prompt")
    ids = backend.text_ids(body["prompt"])
    logprobs = number(body, "logprobs", lo=0, hi=20, integer=True)
    stream, include_usage = _streaming(body)
    grammar = response_format_grammar(backend.grammars, body.get("response_format"))
    job = await _job(backend, body, ids, "max_tokens", grammar, logprobs)
    handle = await backend.start(job)
    reply_id = "cmpl-" + uuid.uuid4().hex
    if stream:
        return StreamingResponse(_completion_stream(backend, handle, reply_id, model,
                                                    include_usage, logprobs),
                                 media_type="text/event-stream")
    reply = await backend.collect(handle, receive)
    return JSONResponse({
        "id": reply_id, "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": reply.text, "finish_reason": _finish(reply, []),
                     "logprobs": _completion_logprobs(backend, reply.logprobs, 0)
                     if logprobs is not None else None}],
        "usage": usage(reply.stats)})


def _completion_logprobs(backend: Backend, entries: list[Any], offset: int) -> dict[str, Any]:
    decode = backend.engine.tokenizer.decode
    tokens = [decode([e.token]) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


async def _completion_stream(backend: Backend, handle: Any, reply_id: str, model: str,
                             include_usage: bool, logprobs: int | None) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, lps: Any = None) -> str:
        return sse({"id": reply_id, "object": "text_completion", "created": created,
                    "model": model, "choices": [{"index": 0, "text": text,
                                                 "finish_reason": finish, "logprobs": lps}]})

    text_chunk = sse_text(chunk)

    reply, offset = Reply(), 0

    def text_chunks(event: Any) -> list[str]:
        nonlocal offset
        lps = _completion_logprobs(backend, list(event.logprobs), offset) \
            if logprobs is not None else None
        offset += len(event.text)
        if lps:
            return [chunk(event.text, lps=lps)]
        return [text_chunk(event.text)] if event.text else []

    try:
        async for piece in backend.writes(handle, reply, text_chunks):
            yield piece
    except APIError as exc:
        yield sse(exc.openai_body()) + "data: [DONE]\n\n"
        return
    end = [chunk("", _finish(reply, []))]
    if include_usage:
        end.append(sse({"id": reply_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [], "usage": usage(reply.stats)}))
    yield "".join(end) + "data: [DONE]\n\n"
