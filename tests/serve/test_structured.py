"""Structured replies through a live server: tool calls round trip with both clients (the
model's own <tool_call> format, forced by tool_choice through a grammar), and a
response_format JSON schema is enforced (the reply validates) or refused with a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
REPLY = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                   "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
                   "checked": {"type": "boolean"}},
    "required": ["answer", "confidence", "checked"],
    "additionalProperties": False,
}


def test_a_forced_tool_call_round_trips_through_the_openai_client(openai_client, model_id):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = openai_client.chat.completions.create(
        model=model_id, messages=messages, tools=TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = openai_client.chat.completions.create(model=model_id, messages=messages,
                                                   tools=TOOLS, tool_choice="none",
                                                   max_tokens=8)
    assert second.choices[0].message.tool_calls is None
    # The call and its result are in the prompt: it grew by both.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_a_streamed_forced_tool_call_arrives_as_tool_call_deltas(openai_client, model_id):
    chunks = list(openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice="required", max_tokens=200, stream=True))
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks)


def test_a_forced_tool_call_round_trips_through_the_anthropic_client(anthropic_client,
                                                                      model_id):
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = anthropic_client.messages.create(model=model_id, max_tokens=200, tools=tools,
                                             tool_choice={"type": "tool", "name": "get_weather"},
                                             messages=messages)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "21 degrees"}]}]
    second = anthropic_client.messages.create(model=model_id, max_tokens=8, tools=tools,
                                              messages=messages)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens + 20


def test_a_json_schema_reply_validates(openai_client, model_id):
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Is it raining?"}],
        max_tokens=200, temperature=0.9, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "reply", "schema": REPLY, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), REPLY)


def test_json_object_mode_replies_with_an_object(openai_client, model_id):
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "JSON please"}], max_tokens=48,
        response_format={"type": "json_object"},
        extra_body={"foretell": {"top_k": 4}}, temperature=0.7, seed=1)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_why(openai_client, model_id):
    import openai

    with pytest.raises(openai.BadRequestError, match="cannot be enforced.*not"):
        openai_client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "r", "schema": {"type": "object", "not": {"required": ["a"]}}}})


def test_a_json_schema_completion_on_the_demo_validates(demo_client):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["name", "args"], "additionalProperties": False}
    reply = demo_client.completions.create(
        model="demo", prompt="config = ", max_tokens=60,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "c", "schema": schema}}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
