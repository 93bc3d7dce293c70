import random

import pytest

from foretell.spec import Feed
from foretell_ngram import NgramConfig
from foretell_ngram.lookup import NgramProvider


def _source(**config):
    return NgramProvider(NgramConfig(**config)).open()


def _draft(source, feed, n):
    return source.draft(Feed(list(feed)), n).tokens[0].tolist()


def test_proposes_what_followed_the_last_matching_ngram():
    source = _source(max_ngram=2)
    source.prefill(Feed([1, 2, 3, 4, 9, 1, 2]))
    assert _draft(source, [], 3) == [3, 4, 9]


def test_prefers_the_longest_suffix_match():
    source = _source(max_ngram=3)
    source.prefill(Feed([5, 7, 1, 8, 6, 7, 2, 5, 7]))
    # suffix [5, 7] occurred at the start, followed by 1; [7] alone matched later, followed by 2
    assert _draft(source, [], 1) == [1]


def test_feed_extends_history_and_no_match_drafts_nothing():
    source = _source()
    source.prefill(Feed([1, 2, 3]))
    assert _draft(source, [4], 2) == []
    assert _draft(source, [1, 2], 2) == [3, 4]


def test_a_shallow_match_proposes_twice_its_depth_and_a_full_one_everything():
    source = _source(max_ngram=3, tokens_per_match=2)
    source.prefill(Feed([9, 1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert _draft(source, [], 8) == [1, 2]  # [9] matched one token deep
    assert _draft(source, [1, 2], 8) == [3, 4, 5, 6, 7, 8, 9, 1]  # [9, 1, 2]: full depth
    unlimited = _source(max_ngram=3, tokens_per_match=0)
    unlimited.prefill(Feed([9, 1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert _draft(unlimited, [], 8) == [1, 2, 3, 4, 5, 6, 7, 8]


def _rescan(history, n, max_ngram, min_ngram, tokens_per_match):
    """The definition: the latest earlier occurrence of the longest matching suffix; a match
    shallower than max_ngram proposes at most tokens_per_match tokens per matched token."""
    for size in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-size:]
        for start in range(len(history) - size - 1, -1, -1):
            if history[start : start + size] == suffix:
                if tokens_per_match and size < max_ngram:
                    n = min(n, tokens_per_match * size)
                return history[start + size : start + size + n]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_proposes_what_a_full_rescan_finds(seed):
    rng = random.Random(seed)
    max_ngram, min_ngram, per_match = rng.randint(1, 4), 1, rng.randint(0, 2)
    source = _source(max_ngram=max_ngram, min_ngram=min_ngram, tokens_per_match=per_match)
    history = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
    source.prefill(Feed(list(history)))
    for _ in range(300):
        feed = [rng.randrange(6) for _ in range(rng.randint(0, 3))]
        history += feed
        n = rng.randint(1, 9)
        assert _draft(source, feed, n) == _rescan(history, n, max_ngram, min_ngram, per_match)


def test_config_rejects_min_above_max():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramConfig(max_ngram=1, min_ngram=2)


def test_config_rejects_a_negative_tokens_per_match():
    with pytest.raises(ValueError, match="tokens_per_match"):
        NgramConfig(tokens_per_match=-1)


@pytest.mark.parametrize("seed", range(3))
def test_a_restored_source_proposes_what_the_captured_one_does(seed):
    """capture/restore (the cache stores the index with the target's entry): a source
    restored from a capture and the source it was captured from propose the same drafts
    from then on, without the restored one re-indexing the history."""
    rng = random.Random(seed)
    original = _source(max_ngram=3)
    history = [rng.randrange(5) for _ in range(rng.randint(1, 40))]
    original.prefill(Feed(list(history)))
    state = original.capture()
    restored = _source(max_ngram=3)
    indexed = []
    extend = restored.index.extend
    restored.index.extend = lambda tokens: indexed.append(len(tokens)) or extend(tokens)
    restored.restore(state, list(history))
    assert indexed == []
    for _ in range(100):
        feed, n = [rng.randrange(5) for _ in range(rng.randint(0, 3))], rng.randint(1, 5)
        assert _draft(restored, feed, n) == _draft(original, feed, n)


def test_restore_refuses_a_state_of_another_length():
    source = _source()
    source.prefill(Feed([1, 2, 3, 1, 2]))
    with pytest.raises(ValueError, match="covers 5 tokens"):
        _source().restore(source.capture(), [1, 2, 3])
