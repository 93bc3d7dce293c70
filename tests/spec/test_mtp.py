"""Qwen-MTP on the shipped demo target (which carries an mtp.* head): greedy output equals
plain greedy decoding, chained or not, and the head actually predicts (it is accepted
often, so the test exercises accepted bursts, not only rejections)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def demo():
    import foretell

    return foretell.load("demo")


PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def"]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafting_reproduces_plain_greedy(demo, k):
    speculator = demo.use_draft("mtp", max_tokens=k, adaptive=False)
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = demo.generate_text(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                   speculate=False)
        events = list(demo.generate(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                    speculate=speculator))
        assert "".join(e.text for e in events[:-1]) == plain
        accepted += events[-1].speculation["accepted"]
        drafted += events[-1].speculation["drafted"]
    assert accepted / drafted > 0.5


def test_mtp_needs_the_hidden_and_mtp_ports(demo):
    from foretell.spec import PORT_HIDDEN, PORT_MTP

    speculator = demo.use_draft("mtp")
    assert speculator.provider.requires == {PORT_HIDDEN, PORT_MTP}
    assert PORT_MTP in demo.model.capabilities
