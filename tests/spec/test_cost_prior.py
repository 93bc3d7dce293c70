"""A drafter declares what a drafted token costs before any round is timed: the two-model
drafter its weights' bytes over the target's (the target drafting for itself: 1), and the
speculator's length policy starts from it. A declaration that is no cost is refused, naming
the plugin."""

from __future__ import annotations

import pytest
from mlx.utils import tree_flatten

from foretell.errors import DraftError
from foretell.model import load_model
from foretell.plugin import Kind
from foretell.spec import make_speculator
from foretell.spec.cost_prior import declared_draft_cost
from foretell.tools import make_model_dir


def _bytes(model) -> int:
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def _two_model(engine, registry, draft_dir):
    config = registry.get(Kind.DRAFT, "two-model").config
    return make_speculator(registry, engine.target, "two-model", config(model=str(draft_dir)))


def test_the_two_model_drafter_declares_its_weights_bytes_over_the_targets(
        engines, model_dirs, registry, tmp_path):
    small = make_model_dir(tmp_path / "small", "qwen3", seed=3, quantize_bits=8,
                           overrides={"hidden_size": 64, "num_hidden_layers": 1,
                                      "intermediate_size": 64})
    engine = engines["qwen3"]
    speculator = _two_model(engine, registry, small)
    ratio = _bytes(load_model(small, registry)) / _bytes(engine.model)
    assert 0 < ratio < 1
    assert speculator.draft_cost == pytest.approx(ratio)
    assert speculator.provider.draft_cost() == speculator.draft_cost
    # Cheaper than a target step: the policy warms up at the longest length as before.
    assert speculator.policy.draft_cost == speculator.draft_cost
    assert speculator.policy.choose(100) == speculator.max_tokens


def test_the_target_drafting_for_itself_declares_one_step_and_skips_the_warm_up(
        engines, model_dirs, registry):
    speculator = _two_model(engines["qwen3"], registry, model_dirs["qwen3"])
    assert speculator.draft_cost == 1.0
    assert speculator.policy.draft_cost == 1.0
    assert speculator.policy.choose(100) == 0  # plain steps timed first, no blind warm-up


class _Declares:
    def __init__(self, cost):
        self.cost = cost

    def draft_cost(self):
        if isinstance(self.cost, Exception):
            raise self.cost
        return self.cost


def test_a_provider_without_a_declaration_declares_nothing():
    assert declared_draft_cost(object(), "draft provider 'x'") is None
    assert declared_draft_cost(_Declares(None), "draft provider 'x'") is None
    assert declared_draft_cost(_Declares(2), "draft provider 'x'") == 2.0


@pytest.mark.parametrize("cost", [-0.5, float("nan"), float("inf"), True, "1", [1.0]])
def test_a_declared_cost_that_is_no_cost_is_refused_naming_the_plugin(cost):
    with pytest.raises(DraftError, match="draft provider 'x' from plugin y: draft_cost"):
        declared_draft_cost(_Declares(cost), "draft provider 'x' from plugin y")


def test_a_declaration_that_raises_is_a_draft_error_naming_the_plugin():
    with pytest.raises(DraftError, match=r"draft provider 'x' failed in draft_cost\(\): "
                                         "RuntimeError: no weights"):
        declared_draft_cost(_Declares(RuntimeError("no weights")), "draft provider 'x'")
