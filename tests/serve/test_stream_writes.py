"""Each streaming route writes the events that arrived together in one piece: a batch
step makes a token for every row, and each write of a stream goes through the ASGI stack
and a socket send on the event loop the worker shares the interpreter with."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")

from foretell.serve import anthropic_routes, generation, openai_routes  # noqa: E402
from foretell.stream import Stats, TextEvent  # noqa: E402

STATS = Stats(prompt_tokens=3, generated_tokens=4, cached_tokens=0, ttft_s=0.01,
              prompt_tps=1.0, generation_tps=1.0, peak_memory_gb=0.0, finish_reason="length")


class Backend:
    """What the routes read: two steps' worth of tokens, then the request's end."""

    def __init__(self) -> None:
        self.metrics = None

    async def batches(self, handle):
        yield [TextEvent("a", (1,)), TextEvent("b", (2,)), TextEvent("c", (3,))]
        yield [TextEvent("d", (4,)), STATS]

    writes = generation.Backend.writes  # the server's own, over these batches


def writes(stream) -> list[str]:
    async def main() -> list[str]:
        return [piece async for piece in stream]

    return asyncio.run(main())


def payloads(piece: str) -> list[dict]:
    return [json.loads(line[6:]) for line in piece.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_completion_stream_writes_each_batch_in_one_piece():
    out = writes(openai_routes._completion_stream(Backend(), None, "cmpl-1", "m", True, None))
    assert [[p["choices"][0]["text"] for p in payloads(piece)] for piece in out[:2]] == [
        ["a", "b", "c"], ["d"]]
    # The end (finish reason, usage, [DONE]) is one more write.
    assert len(out) == 3 and out[2].endswith("data: [DONE]\n\n")
    assert payloads(out[2])[-1]["usage"]["completion_tokens"] == 4


def test_a_chat_stream_writes_each_batch_in_one_piece():
    out = writes(openai_routes._chat_stream(Backend(), None, "chat-1", "m", False, False,
                                            False))
    texts = [[p["choices"][0]["delta"].get("content") for p in payloads(piece)]
             for piece in out[1:3]]
    assert texts == [["a", "b", "c"], ["d"]]
    assert len(out) == 4 and payloads(out[3])[-1]["choices"][0]["finish_reason"] == "length"


def test_a_messages_stream_writes_each_batch_in_one_piece():
    backend = Backend()
    backend.engine = None
    out = writes(anthropic_routes._stream(backend, type("H", (), {"prompt_tokens": 3})(),
                                          "msg-1", "m", False, ()))
    deltas = [[p["delta"]["text"] for p in payloads(piece)
               if p["type"] == "content_block_delta"] for piece in out[1:3]]
    assert deltas == [["a", "b", "c"], ["d"]]
    assert out[-1].endswith('"type": "message_stop"}\n\n')


@pytest.mark.parametrize("text", ["", "a", "é\n\"\\", "\ue000", "\x00\u2028", "x" * 300])
def test_a_chunk_from_the_template_is_the_chunk_encoded_whole(text):
    def make(t):
        return {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                "choices": [{"index": 0, "text": t, "finish_reason": None, "logprobs": None}]}

    def chunk(t):
        return openai_routes.sse(make(t))

    assert openai_routes.sse_text(chunk)(text) == chunk(text)
    odd = openai_routes.sse_text(lambda t: openai_routes.sse({**make(t), "model": "\ue000"}))
    assert odd(text) == openai_routes.sse({**make(text), "model": "\ue000"})
