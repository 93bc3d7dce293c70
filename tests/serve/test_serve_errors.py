"""Bad requests get a 4xx and the API's error JSON with a message that says what was wrong;
none gets a traceback or a 500."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def auth(api_key):
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}


def error_of(response):
    status, _, body = response
    return status, json.loads(body)["error"]


def test_malformed_json_is_a_400_saying_where(server, auth):
    status, error = error_of(server.request("POST", "/v1/chat/completions",
                                            '{"model": "x", "messages": [', auth))
    assert status == 400 and error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"] and "column" in error["message"]


def test_a_body_that_is_not_an_object_is_a_400(server, auth):
    status, error = error_of(server.request("POST", "/v1/completions", "[1, 2]", auth))
    assert status == 400 and "must be a JSON object" in error["message"]


def test_an_unknown_field_is_a_400_naming_it(openai_client, model_id):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "x"}],
            extra_body={"temprature": 0.5})
    assert caught.value.body["param"] == "temprature"
    assert "unknown field 'temprature'" in caught.value.body["message"]


def test_an_unknown_extension_option_is_a_400_naming_it(openai_client, model_id):
    import openai

    with pytest.raises(openai.BadRequestError, match="unknown field 'foretell.drafter'"):
        openai_client.completions.create(model=model_id, prompt="x",
                                         extra_body={"foretell": {"drafter": "mtp"}})


def test_a_wrong_type_or_range_is_a_400_naming_the_field(openai_client, model_id):
    import openai

    with pytest.raises(openai.BadRequestError, match="'temperature' must be between 0 and 2"):
        openai_client.completions.create(model=model_id, prompt="x", temperature=7)
    with pytest.raises(openai.BadRequestError, match=r"'messages\[0\].content' must be"):
        openai_client.chat.completions.create(model=model_id,
                                              messages=[{"role": "user", "content": 5}])
    with pytest.raises(openai.BadRequestError, match="'n' = 3 is not supported"):
        openai_client.completions.create(model=model_id, prompt="x", n=3)


def test_a_wrong_model_name_is_a_404_listing_the_served_one(openai_client, model_id):
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.chat.completions.create(model="gpt-4o",
                                              messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["code"] == "model_not_found"
    assert model_id in caught.value.body["message"]


def test_a_prompt_past_the_context_is_a_400_with_the_numbers(openai_client, model_id):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=model_id, prompt="word " * 3000, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "context is 2048 tokens" in caught.value.body["message"]


def test_a_body_over_the_size_bound_is_a_413(server, auth):
    status, error = error_of(server.request("POST", "/v1/completions",
                                            b"x" * (33 << 20), auth))
    assert status == 413 and "MiB" in error["message"]


def test_a_missing_api_key_is_a_401_in_each_apis_shape(server):
    status, _, body = server.request("GET", "/v1/models")
    assert status == 401 and "missing API key" in json.loads(body)["error"]["message"]
    status, _, body = server.request("POST", "/v1/messages", {"model": "x"})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"


def test_a_wrong_api_key_is_a_401_for_both_clients(server, model_id):
    import anthropic
    import openai

    openai_client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        openai_client.models.list()
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic_client.messages.create(model=model_id, max_tokens=2,
                                         messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["message"] == "invalid API key"


def test_health_and_metrics_need_no_key(server):
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/metrics")[0] == 200


def test_an_unknown_route_is_a_404_in_json(server, auth):
    status, error = error_of(server.request("GET", "/v1/engines", headers=auth))
    assert status == 404 and "no route GET /v1/engines" in error["message"]


def test_no_request_above_left_a_traceback_or_a_500(server):
    assert "Traceback" not in server.log
    assert not [k for k in server.metrics() if 'status="500"' in k]
