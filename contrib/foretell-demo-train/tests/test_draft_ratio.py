"""The target/draft size rule is one check, used before the draft trains and at export."""

import copy

import pytest

pytest.importorskip("torch")

from foretell_demo_train.pipeline import require_draft_ratio  # noqa: E402
from foretell_demo_train.presets import FULL  # noqa: E402


def test_ratio_at_or_above_the_minimum_passes_and_below_names_both_counts():
    preset = copy.deepcopy(FULL)
    require_draft_ratio(preset, 8_000, 1_000)
    with pytest.raises(RuntimeError, match=r"ratio 7\.99 < 8\.0 \(7,990 / 1,000\)"):
        require_draft_ratio(preset, 7_990, 1_000)
