"""Prompt lookup: the longest earlier occurrence of the suffix and what followed it."""

from __future__ import annotations

from asyncengine.spec_decode.ngram import ngram_drafts


def test_copies_what_followed_the_suffix() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3]
    assert ngram_drafts(tokens, 1, 3, 3) == [4, 5, 6]


def test_longest_suffix_wins() -> None:
    # "3" alone last occurred before 8; "2 3" occurred before 4.
    tokens = [2, 3, 4, 5, 3, 8, 2, 3]
    assert ngram_drafts(tokens, 1, 2, 2) == [4, 5]
    assert ngram_drafts(tokens, 1, 1, 2) == [8, 2]


def test_min_length_and_no_match() -> None:
    assert ngram_drafts([1, 2, 3, 4], 1, 3, 2) == []
    assert ngram_drafts([5, 6, 7, 5], 2, 3, 2) == []  # only a 1-gram matches
    assert ngram_drafts([5, 6, 7, 5], 1, 3, 2) == [6, 7]
    assert ngram_drafts([5], 1, 3, 2) == []


def test_prefers_a_match_with_a_full_continuation() -> None:
    # A run: the latest match is followed by one token only; an earlier one by k.
    tokens = [7, 7, 7, 7, 7]
    assert ngram_drafts(tokens, 1, 2, 2) == [7, 7]
    tokens = [1, 2, 9, 9, 1, 2, 8, 1, 2]
    assert ngram_drafts(tokens, 1, 2, 2) == [8, 1]
    assert ngram_drafts(tokens, 1, 2, 3) == [8, 1, 2]
    assert ngram_drafts(tokens, 1, 2, 4) == [9, 9, 1, 2]  # only the first has 4 after it
