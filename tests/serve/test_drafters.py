"""The extension field chooses a request's drafter by name (or none): the reply is the one
plain decoding gives, and the server's metrics count what was drafted and accepted."""

from __future__ import annotations

import pytest


def test_a_request_naming_a_drafter_speculates_and_replies_as_plain_decoding(demo_server,
                                                                             demo_client):
    prompt = "def parse_header(line):\n    "  # not asked before: no cached prefix
    before = demo_server.metrics()["foretell_draft_tokens_total"]
    drafted = demo_client.completions.create(model="demo", prompt=prompt, max_tokens=48,
                                             extra_body={"foretell": {"draft": "mtp"}})
    after = demo_server.metrics()
    assert after["foretell_draft_tokens_total"] > before
    assert after["foretell_draft_accepted_tokens_total"] > 0
    plain = demo_client.completions.create(model="demo", prompt=prompt, max_tokens=48,
                                           extra_body={"foretell": {"draft": "none"}})
    assert drafted.choices[0].text == plain.choices[0].text
    assert demo_server.metrics()["foretell_draft_tokens_total"] == \
        after["foretell_draft_tokens_total"]


def test_a_drafter_that_cannot_serve_the_model_is_a_400_saying_why(openai_client, model_id):
    import openai

    # The tiny model has no multi-token-prediction head for "mtp" to draft with.
    with pytest.raises(openai.BadRequestError, match="'foretell.draft'.*mtp"):
        openai_client.completions.create(model=model_id, prompt="x", max_tokens=2,
                                         extra_body={"foretell": {"draft": "mtp"}})
