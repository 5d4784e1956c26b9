"""The stop-string automaton against finding the strings afresh in the whole text each time."""

import random

import pytest

from tpgraph.engine.stop_strings import StopScanner


def found_afresh(before: str, piece: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """vLLM's check_stop_strings: the first stop string in the list that ends in `piece` (at its first such place),
    as (its start counted back from the text's end, the string)."""
    text = before + piece
    for s in stops:
        if (i := text.find(s, max(0, len(before) - len(s) + 1))) >= 0:
            return len(text) - i, s
    return None


@pytest.mark.parametrize("stops, expected", [
    (("bc", "abcd"), (3, "bc")),  # listed first, though "abcd" starts first
    (("abcd", "bc"), (4, "abcd")),  # listed first, though "bc" ends first
    (("cd", "abcd"), (2, "cd")),
    (("abcd", "cd"), (4, "abcd")),
])
def test_the_first_listed_stop_string_found_wins(stops, expected):
    """One piece completing two stop strings: vLLM's check_stop_strings walks the stop list and takes the first string
    found in the new text, wherever the others end (the one ending first was taken here, so stop ['abcd', 'bc'] on
    'abcd' kept 'a' where vLLM keeps nothing)."""
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
        stops = tuple(dict.fromkeys(words))  # (deduplicated in a fixed order: a failure reproduces)
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


def test_a_requests_samples_share_their_stop_strings_tables(monkeypatch):
    """Each of a request's n samples has a scanner (its detokenizer's), all built on the engine's thread as the request
    is taken: each built its own tables, so n = 1000 with a hundred long stop strings held every other request for
    seconds. The tables are made once for the list; each scanner keeps its own states."""
    from tpgraph.engine import stop_strings

    built = []
    real = stop_strings._failure
    monkeypatch.setattr(stop_strings, "_failure", lambda s: built.append(s) or real(s))
    stops = tuple(f"stop-{i}-" + "x" * 50 for i in range(3))
    scanners = [StopScanner(stops) for _ in range(1000)]
    assert len(built) == 3
    assert scanners[0].feed("..stop-1-" + "x" * 50) == (len(stops[1]), stops[1])
    assert scanners[1].feed("..stop-2-" + "x" * 49) is None and scanners[1].held == len(stops[2]) - 1
