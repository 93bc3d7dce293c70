"""The two-model source drafts what the draft model itself says next: each greedy draft is
mlx-lm's greedy continuation of the sequence on the same weights, however the last round
ended (every draft kept, some, none, plain steps after it), and whatever tokens its caches
lack ride in the first draft's forward (n forwards for n drafts, never one more)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from foretell.model import load_model
from foretell.sampling import Sampler
from foretell.spec import Feed
from foretell_two_model.source import TwoModelSource


def _count_forwards(source) -> list[int]:
    """The lengths of the draft model's forwards from now on, in order."""
    forwards = []
    real_forward = source.model.forward
    source.model.forward = lambda tokens, caches: (forwards.append(tokens.shape[1]),
                                                   real_forward(tokens, caches))[1]
    return forwards


def _caught_up(model_dir, registry) -> TwoModelSource:
    """A source that heard a 20-token prompt and one round that kept nothing."""
    source = TwoModelSource(load_model(model_dir, registry), Sampler())
    source.prefill(Feed(list(range(3, 23))))
    source.draft(Feed([]), 2)
    source.commit(0)
    return source


def _mlx_lm_greedy(lm, sequence: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(mx.array(sequence), lm, max_tokens=n)]


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])  # gemma: a window of 8 that wraps
def test_each_draft_is_the_draft_models_greedy_continuation(name, model_dirs, registry):
    import mlx_lm

    lm, _ = mlx_lm.load(str(model_dirs[name]))
    source = TwoModelSource(load_model(model_dirs[name], registry), Sampler())
    forwards = _count_forwards(source)
    sequence = list(range(3, 23))
    source.prefill(Feed(list(sequence)))

    # (what the round kept, the tokens the verifier feeds next, the next draft's length)
    rounds = [
        (4, lambda d: d + [5], 3),            # every draft kept, then the target's token
        (1, lambda d: d[:1] + [9], 2),        # one kept
        (0, lambda d: [11, 12, 13, 14], 4),   # none kept, then plain steps
        (2, lambda d: d[:2] + [6], 4),
    ]
    draft = source.draft(Feed([]), 4).tokens.tolist()[0]
    assert draft == _mlx_lm_greedy(lm, sequence, 4)
    for kept, fed, n in rounds:
        source.commit(kept)
        feed = fed(draft)
        # The caches hold the drafts fed (all but the last) that were kept; the rest of the
        # feed is new to them.
        new = len(feed) - min(kept, len(draft) - 1)
        sequence += feed
        forwards.clear()
        draft = source.draft(Feed(feed), n).tokens.tolist()[0]
        assert draft == _mlx_lm_greedy(lm, sequence, n), (kept, feed)
        assert forwards == [new] + [1] * (n - 1)  # what the caches lacked, in one forward


def test_a_source_far_behind_starts_over_from_the_last_tokens(model_dirs, registry):
    """After a long plain stretch the source does not run every skipped token through the
    draft model: it starts its caches over from the sequence's last CATCH_UP_MAX tokens, in
    one forward, and drafts what the draft model says after those tokens alone (mlx-lm's
    greedy continuation of them, as a fresh sequence)."""
    import mlx_lm

    from foretell_two_model.source import CATCH_UP_MAX

    lm, _ = mlx_lm.load(str(model_dirs["qwen3"]))
    source = _caught_up(model_dirs["qwen3"], registry)
    forwards = _count_forwards(source)
    stretch = [(7 * i) % 90 + 5 for i in range(CATCH_UP_MAX + 20)]  # plain steps' tokens
    sequence = list(range(3, 23)) + stretch
    draft = source.draft(Feed(stretch), 3).tokens.tolist()[0]
    assert forwards == [CATCH_UP_MAX, 1, 1]
    assert draft == _mlx_lm_greedy(lm, sequence[-CATCH_UP_MAX:], 3)

    # Its state, captured after the start-over, restores into a new source that drafts the
    # same as the first one from there on.
    source.commit(1)
    state = source.capture()
    feed = draft[:1] + [41]
    again = TwoModelSource(source.model, Sampler())
    again.restore(state, list(sequence))
    assert again.draft(Feed(list(feed)), 3).tokens.tolist() == \
        source.draft(Feed(list(feed)), 3).tokens.tolist()


def test_a_source_a_few_tokens_behind_catches_up_on_all_of_them(model_dirs, registry):
    from foretell_two_model.source import CATCH_UP_MAX

    source = _caught_up(model_dirs["qwen3"], registry)
    forwards = _count_forwards(source)
    source.draft(Feed(list(range(5, 5 + CATCH_UP_MAX))), 1)  # exactly the most it catches up
    assert forwards == [CATCH_UP_MAX] and source.base == 0
