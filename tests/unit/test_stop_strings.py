"""The stop-string automaton against finding the strings afresh in the whole text each time."""

import random

import pytest

from tpgraph.engine.stop_strings import StopScanner


def found_afresh(before: str, piece: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """vLLM's check_stop_strings: the stop string ending in `piece` that completes first (ties to the first in the
    list), as (its start counted back from the text's end, the string)."""
    text = before + piece
    hits = [(i + len(s), j, i, s) for j, s in enumerate(stops)
            if (i := text.find(s, max(0, len(before) - len(s) + 1))) >= 0]
    if not hits:
        return None
    _, _, i, s = min(hits)
    return len(text) - i, s


@pytest.mark.parametrize("stops, expected", [
    (("bc", "abcd"), (3, "bc")),  # ends first, though "abcd" starts first
    (("abcd", "bc"), (3, "bc")),
    (("cd", "abcd"), (2, "cd")),  # both end at "d": the first in the list
    (("abcd", "cd"), (4, "abcd")),
])
def test_the_stop_string_completing_first_wins_then_the_first_listed(stops, expected):
    """One piece completing two stop strings: vLLM's check_stop_strings takes the one that ends first, at one end the
    first in the stop list (the starting-first one, ties to the smaller string, was taken here)."""
    assert StopScanner(stops).feed("abcd") == expected


def held_afresh(text: str, stops: tuple[str, ...]) -> int:
    """The longest tail of the text that some stop string begins with and is longer than. (A whole string there ended
    before min_tokens, or it would have stopped the text: it stops nothing now, and is not held.)"""
    longest = max(len(s) for s in stops) - 1
    return next((k for k in range(min(longest, len(text)), 0, -1)
                 if any(s.startswith(text[-k:]) and k < len(s) for s in stops)), 0)


def test_it_finds_and_holds_what_finding_afresh_does():
    rng = random.Random(0)
    letters = "aabc"  # (few letters: strings that overlap themselves and each other)
    for _ in range(3000):
        words = ("".join(rng.choice(letters) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
        stops = tuple(set(words))
        scanner, text = StopScanner(stops), ""
        for _ in range(rng.randint(1, 12)):
            piece = "".join(rng.choice(letters + "d") for _ in range(rng.randint(0, 4)))
            may_stop = rng.random() < 0.8
            hit = scanner.feed(piece, may_stop)
            assert hit == (found_afresh(text, piece, stops) if may_stop else None), (stops, text, piece)
            text += piece
            if hit is not None:
                break
            assert scanner.held == held_afresh(text, stops), (stops, text)


def test_a_long_stop_string_costs_each_character_little():
    """Text that keeps almost matching a long string (the worst case of looking afresh: every tail a candidate)."""
    stop = "a" * 5000 + "b"
    scanner = StopScanner((stop, "zz"))
    for _ in range(2000):
        assert scanner.feed("aaaa") is None
    assert scanner.held == 5000
    assert scanner.feed("ab") == (5001, stop)
