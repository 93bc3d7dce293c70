"""The official ``anthropic`` client against a live ``foretell serve``: messages whole and
streamed, system prompts, stop sequences, prompt-cache usage and token counting."""

from __future__ import annotations

import pytest

SYSTEM = "You answer in short sentences about the Python standard library. " * 6


def test_a_message_reports_its_text_stop_reason_and_usage(anthropic_client, model_id):
    reply = anthropic_client.messages.create(
        model=model_id, max_tokens=6, system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"foretell": {"ignore_eos": True}})
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 6


def test_a_streamed_message_is_the_same_text_as_the_whole_one(anthropic_client, model_id):
    ask = {"model": model_id, "max_tokens": 10, "extra_body": {"foretell": {"ignore_eos": True}},
           "messages": [{"role": "user", "content": [{"type": "text", "text": "Count"}]}]}
    whole = anthropic_client.messages.create(**ask)
    with anthropic_client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10


def test_a_stop_sequence_is_reported_as_the_one_that_stopped_it(anthropic_client, model_id):
    ask = {"model": model_id, "max_tokens": 16, "extra_body": {"foretell": {"ignore_eos": True}},
           "messages": [{"role": "user", "content": "Go on"}]}
    text = anthropic_client.messages.create(**ask).content[0].text
    stop = text[5:8]
    reply = anthropic_client.messages.create(**ask, stop_sequences=["@@never@@", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[: text.index(stop)]


def test_usage_reports_cache_reads_for_a_repeated_system_prompt(anthropic_client, model_id):
    def ask(question):
        return anthropic_client.messages.create(model=model_id, max_tokens=4, system=SYSTEM,
                                                messages=[{"role": "user", "content": question}])

    first = ask("A1")
    second = ask("A2")
    assert first.usage.input_tokens > 100
    assert second.usage.cache_read_input_tokens > 100
    assert second.usage.input_tokens <= 16  # only the new turn was computed


def test_count_tokens_counts_what_a_message_would_take(anthropic_client, model_id):
    ask = {"model": model_id, "system": "Be brief.",
           "messages": [{"role": "user", "content": "How many tokens is this?"}]}
    counted = anthropic_client.messages.count_tokens(**ask).input_tokens
    used = anthropic_client.messages.create(**ask, max_tokens=1).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens


def test_errors_come_back_in_anthropics_shape(anthropic_client, model_id):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(model=model_id, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in caught.value.body["error"]["message"]
