"""A request's life beside the server's: a client that goes away frees its row at once, the
waiting bound answers 429 with Retry-After, and SIGTERM lets what is in flight finish, flushes
the cache to disk, says so and exits 0."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from serve_helpers import Server


def open_stream(server, body, headers=None):
    """A streaming request left open: the connection, and its first SSE line."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    first = response.readline()
    return connection, response, first


def wait_for(condition, what):
    """Poll ``condition`` (a bounded wait, for the server's worker to get there)."""
    for _ in range(600):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def sse_events(response):
    events = []
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_a_client_that_disconnects_mid_stream_frees_its_row_and_the_next_request_works(
        server, api_key, model_id):
    auth = {"Authorization": f"Bearer {api_key}"}
    before = server.metrics()["foretell_requests_cancelled_total"]
    connection, _, first = open_stream(server, {
        "model": model_id, "prompt": "def f(x):", "max_tokens": 2000,
        "foretell": {"ignore_eos": True}}, auth)
    assert first.startswith(b"data: ")
    wait_for(lambda: server.metrics()["foretell_running_requests"] == 1, "it ran")
    connection.close()
    wait_for(lambda: server.metrics()["foretell_running_requests"] == 0, "its row was freed")
    metrics = server.metrics()
    assert metrics["foretell_requests_cancelled_total"] == before + 1
    assert metrics["foretell_live_kv_bytes"] == 0
    status, _, body = server.request("POST", "/v1/completions", {
        "model": model_id, "prompt": "x = 1", "max_tokens": 3}, auth)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1


def test_a_client_that_disconnects_before_a_whole_reply_frees_its_row(server, api_key,
                                                                      model_id):
    before = server.metrics()["foretell_requests_cancelled_total"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps({
        "model": model_id, "prompt": "import sys", "max_tokens": 2000,
        "foretell": {"ignore_eos": True}}), {"Authorization": f"Bearer {api_key}"})
    wait_for(lambda: server.metrics()["foretell_running_requests"] == 1, "it ran")
    connection.close()  # before any of the reply came
    wait_for(lambda: server.metrics()["foretell_running_requests"] == 0, "its row was freed")
    assert server.metrics()["foretell_requests_cancelled_total"] == before + 1


def test_past_the_waiting_bound_a_request_gets_429_with_retry_after(tiny_model, tmp_path):
    server = Server("--model", str(tiny_model), "--max-rows", "1", "--max-waiting", "1",
                    cwd=tmp_path)
    try:
        long = {"model": tiny_model.name, "prompt": "def f(x):", "max_tokens": 2000,
                "foretell": {"ignore_eos": True}}
        running, _, _ = open_stream(server, long)
        waiting = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        waiting.request("POST", "/v1/completions", json.dumps(
            {"model": tiny_model.name, "prompt": "x", "max_tokens": 4, "stream": True}))
        queued = waiting.getresponse()  # headers come once it is submitted
        assert queued.status == 200
        status, headers, body = server.request("POST", "/v1/completions", {
            "model": tiny_model.name, "prompt": "y", "max_tokens": 4})
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        running.close()
        assert sse_events(queued)[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("cached", [False, True], ids=["ram", "disk"])
def test_sigterm_lets_the_request_in_flight_finish_flushes_and_exits_0(tiny_model, tmp_path,
                                                                      cached):
    extra = ["--cache-dir", str(tmp_path / "kv")] if cached else []
    server = Server("--model", str(tiny_model), *extra, cwd=tmp_path)
    _, response, first = open_stream(server, {
        "model": tiny_model.name, "prompt": "class Walker:", "max_tokens": 400,
        "foretell": {"ignore_eos": True}, "stream_options": {"include_usage": True}})
    events = []
    reader = threading.Thread(target=lambda: events.extend(sse_events(response)))
    reader.start()
    server.proc.send_signal(15)
    reader.join(timeout=300)
    assert server.stop() == 0
    assert "Waiting for connections to close" in server.log  # it was still running
    assert events[-1]["usage"]["completion_tokens"] == 400
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert "Traceback" not in server.log
    if cached:
        assert "the cache is durable" in server.log
        assert any((tmp_path / "kv").rglob("*"))
