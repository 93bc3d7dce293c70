"""The official ``openai`` client against a live ``foretell serve``: chat and completions,
streaming and not, the options each takes, and what the server reports back."""

from __future__ import annotations

import asyncio
import json

import pytest

SYSTEM = ("You are a careful assistant who answers questions about the Python standard "
          "library, its modules, their functions and the idioms that use them well. ") * 3


def test_models_lists_the_served_model(openai_client, tiny_model):
    assert [m.id for m in openai_client.models.list().data][0] == tiny_model.name


def test_chat_completion_reports_its_text_finish_reason_and_usage(openai_client, model_id):
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
        extra_body={"foretell": {"ignore_eos": True}})
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_streamed_chat_is_the_same_text_as_the_whole_reply(openai_client, model_id):
    ask = {"model": model_id, "messages": [{"role": "user", "content": "Count."}],
           "max_tokens": 12, "extra_body": {"foretell": {"ignore_eos": True}}}
    whole = openai_client.chat.completions.create(**ask).choices[0].message.content
    chunks = list(openai_client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_streams_and_returns_the_same_text(openai_client, model_id):
    whole = openai_client.completions.create(model=model_id, prompt="def fib(n):", max_tokens=10,
                                              extra_body={"foretell": {"ignore_eos": True}})
    streamed = openai_client.completions.create(model=model_id, prompt="def fib(n):",
                                                max_tokens=10, stream=True,
                                                extra_body={"foretell": {"ignore_eos": True}})
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10


def test_a_stop_string_ends_the_reply_before_it(openai_client, model_id):
    free = openai_client.completions.create(model=model_id, prompt="x = 1", max_tokens=16,
                                            extra_body={"foretell": {"ignore_eos": True}})
    text = free.choices[0].text
    stop = text[4:7]
    stopped = openai_client.completions.create(model=model_id, prompt="x = 1", max_tokens=16,
                                               stop=[stop],
                                               extra_body={"foretell": {"ignore_eos": True}})
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_reply(openai_client, model_id):
    def sample(seed):
        return openai_client.completions.create(
            model=model_id, prompt="import os", max_tokens=12, temperature=1.0, seed=seed,
            extra_body={"foretell": {"ignore_eos": True}}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_chat_logprobs_give_each_tokens_and_its_best_alternatives(openai_client, model_id):
    reply = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True,
        top_logprobs=3, extra_body={"foretell": {"ignore_eos": True}})
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert "".join(e.token for e in entries) == reply.choices[0].message.content


def test_usage_reports_cached_tokens_for_a_repeated_system_prompt(openai_client, model_id):
    def ask(question):
        return openai_client.chat.completions.create(
            model=model_id, max_tokens=4, messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": question}])

    first = ask("Q1")
    second = ask("Q2")
    assert first.usage.prompt_tokens > 200
    assert first.usage.prompt_tokens_details.cached_tokens < 10  # the template's opening
    # Only the new user turn and the reply's opening are computed.
    computed = second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    assert 0 < computed <= 16


def test_sixteen_concurrent_streams_get_what_sequential_requests_get(server, tiny_model, model_id):
    import openai

    prompts = [f"def task_{i}(x):" + " x = x + 1;" * (i % 5) for i in range(16)]
    ask = {"max_tokens": 12, "extra_body": {"foretell": {"ignore_eos": True}}}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123", max_retries=0)
    sequential = [client.completions.create(model=model_id, prompt=p, **ask).choices[0].text
                  for p in prompts]

    async def concurrent():
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test-key-123",
                                          max_retries=0)

        async def one(prompt):
            stream = await async_client.completions.create(model=model_id, prompt=prompt,
                                                           stream=True, **ask)
            return "".join([c.choices[0].text async for c in stream])

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(concurrent()) == sequential


def test_unknown_drafter_names_are_refused_with_the_registered_ones(openai_client, model_id):
    import openai

    with pytest.raises(openai.BadRequestError, match="no drafter named 'nope'"):
        openai_client.completions.create(model=model_id, prompt="x", max_tokens=2,
                                         extra_body={"foretell": {"draft": "nope"}})
    ok = openai_client.completions.create(model=model_id, prompt="x", max_tokens=2,
                                          extra_body={"foretell": {"draft": "none"}})
    assert ok.usage.completion_tokens >= 1


def test_metrics_count_requests_tokens_and_the_scheduler(server, openai_client, model_id):
    openai_client.completions.create(model=model_id, prompt="a = 2", max_tokens=3)
    metrics = server.metrics()
    assert metrics['foretell_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert metrics["foretell_generation_tokens_total"] >= 3
    assert metrics["foretell_running_requests"] == 0
    assert metrics["foretell_live_kv_bytes"] == 0
    assert 'foretell_prefix_cache_hits_total{tier="ram"}' in metrics
    for name in ("foretell_time_to_first_token_seconds", "foretell_request_queue_seconds"):
        # Histograms: cumulative buckets, the last holding every request counted.
        buckets = [v for k, v in metrics.items() if k.startswith(name + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == metrics[name + "_count"] >= 1
    assert metrics["foretell_time_to_first_token_seconds_sum"] >= \
        metrics["foretell_request_queue_seconds_sum"]
    assert json.loads(server.request("GET", "/health")[2])["status"] == "ok"
