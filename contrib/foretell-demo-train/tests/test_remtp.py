"""The MTP head retrained through its chain (``remtp``): the training forward computes what the
engine's chained drafting computes, and the command writes a head the engine pairs with."""

import json

import pytest

torch = pytest.importorskip("torch", reason="the demo trainer needs PyTorch, which the [test] extra leaves out")

from foretell_demo_train.models import CausalLM, ModelSpec  # noqa: E402
from foretell_demo_train.mtp import MTPHead, chain_loss, chain_outputs  # noqa: E402

SPEC = ModelSpec(arch="qwen3", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, intermediate_size=96)


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    target = CausalLM(SPEC).eval()
    head = MTPHead(SPEC).eval()
    with torch.no_grad():  # norms away from 1 so a mixed-up input shows
        for p in head.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return target, head


def _engine_chain(head, target, states, ids, anchor, depth):
    """What the engine does at one anchor: its cache holds step 1's entries for every anchor
    up to this one, each chained step appends one entry and runs causally over all of them."""
    layer = head.layers[0]
    xs = head.merge(target, states[:, : anchor + 1], ids[:, 1 : anchor + 2])
    outs = []
    for j in range(1, depth + 1):
        if j > 1:
            xs = torch.cat([xs, head.merge(target, outs[-1], ids[:, anchor + j : anchor + j + 1])],
                           dim=1)
        cos, sin = target.rope("full_attention", xs.shape[1], xs.device)
        outs.append(head.norm(layer(xs, cos, sin, None))[:, -1:])
    return outs


def test_the_chained_forward_is_the_engines_chain_at_every_anchor():
    target, head = _pair()
    depth, T = 4, 9
    ids = torch.randint(0, SPEC.vocab_size, (2, T + depth))
    with torch.no_grad():
        states = target.hidden(ids)[:, :T]
        chained = chain_outputs(head, target, states, ids, depth)
        for anchor in (0, 3, T - 1):
            oracle = _engine_chain(head, target, states, ids, anchor, depth)
            for j in range(depth):
                torch.testing.assert_close(chained[j][:, anchor : anchor + 1], oracle[j],
                                           rtol=1e-4, atol=1e-5)


def test_step_one_is_the_heads_own_one_step_forward():
    target, head = _pair(1)
    ids = torch.randint(0, SPEC.vocab_size, (2, 12))
    with torch.no_grad():
        states = target.hidden(ids)
        first = chain_outputs(head, target, states[:, :10], ids, 2)[0]
        torch.testing.assert_close(first, head(target, states[:, :10], ids[:, 1:11]),
                                   rtol=1e-4, atol=1e-5)


def test_the_chain_loss_trains_the_head_alone():
    target, head = _pair(2)
    target.requires_grad_(False)  # frozen, as remtp runs it
    window = torch.randint(0, SPEC.vocab_size, (2, 17))
    loss = chain_loss(head, target, window, depth=3, decay=0.8)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


@pytest.mark.slow
def test_remtp_writes_a_head_the_engine_drafts_with(produced, stdlib, tmp_path):
    blas = pytest.importorskip("foretell.platform.blas")
    blas.preload()  # before MLX loads, as the engine does
    from foretell_demo_train.cli import main

    out = tmp_path / "out"
    main(["remtp", "--preset", "tiny", "--target-dir", str(produced / "out" / "demo"),
          "--minutes", "0.05", "--depth", "3", "--seq-len", "48", "--batch-size", "8",
          "--eval-prompt-tokens", "16", "--work", str(tmp_path / "work"), "--out", str(out),
          "--roots", stdlib])
    record = json.loads((out / "remtp.json").read_text())
    for name in ("shipped", "retrained"):
        path = record["quality"][name]["greedy_path_prompt_16"]
        kept = path["kept_at_least"]
        assert len(kept) == 3 and all(1 >= a >= b >= 0 for a, b in zip(kept, kept[1:]))
        assert path["expected_accepted_of_3"] == pytest.approx(sum(kept), abs=2e-3)
    config = json.loads((out / "demo" / "config.json").read_text())
    assert "3 steps deep" in config["mtp_config"]["hidden_for_next_step"]

    from foretell import load
    from foretell.plugin.registry import Kind

    engine = load(str(out / "demo"))
    prompt = engine.tokenizer.encode("def main():\n    return", add_special_tokens=False)
    plain = [t for e in engine.generate(prompt, max_tokens=12, ignore_eos=True)
             if e.type == "text" for t in e.tokens]
    config_cls = engine.registry.get(Kind.DRAFT, "mtp").config
    spec = engine.use_draft("mtp", config_cls(draft_vocab=0), max_tokens=3, adaptive=False)
    stats, drafted = None, []
    for event in engine.generate(prompt, max_tokens=12, ignore_eos=True, speculate=spec):
        if event.type == "text":
            drafted += event.tokens
        elif event.type == "stats":
            stats = event
    assert drafted == plain
    assert stats.speculation["drafted"] > 0
