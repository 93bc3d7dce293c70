from foretell_ngram import NgramConfig
from foretell_ngram.lookup import NgramProvider


def test_proposes_what_followed_the_last_matching_ngram():
    source = NgramProvider(NgramConfig(max_ngram=2)).open()
    source.prefill([1, 2, 3, 4, 9, 1, 2])
    assert source.draft([], 3) == [3, 4, 9]


def test_prefers_the_longest_suffix_match():
    source = NgramProvider(NgramConfig(max_ngram=3)).open()
    source.prefill([5, 7, 1, 8, 6, 7, 2, 5, 7])
    # suffix [5, 7] occurred at the start, followed by 1; [7] alone matched later, followed by 2
    assert source.draft([], 1) == [1]


def test_feed_extends_history_and_no_match_drafts_nothing():
    source = NgramProvider(NgramConfig()).open()
    source.prefill([1, 2, 3])
    assert source.draft([4], 2) == []
    assert source.draft([1, 2], 2) == [3, 4]


def test_config_rejects_min_above_max():
    import pytest

    with pytest.raises(ValueError, match="min_ngram"):
        NgramConfig(max_ngram=1, min_ngram=2)
