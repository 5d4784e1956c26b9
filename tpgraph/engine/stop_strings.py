"""Stop strings found as the text grows: each string's Knuth-Morris-Pratt automaton, fed a character at a time.

Per character, each stop string costs amortized O(1), and the automaton's state is the longest tail of the text that
the string begins with: what the detokenizer holds back. (Finding that tail afresh each token cost up to the square of
the longest stop string, times their number: a request with long stop strings stalled every request's step.)
"""

from __future__ import annotations

import functools


# (a few lists: a request's n samples come together; each entry may hold 100 stops of 1000 characters, some 1 MB)
@functools.lru_cache(maxsize=8)
def _failures(stops: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each stop string's failure table, made once for a request's stop list: its n samples each scan with their own
    states, and built again for each sample the tables held up the engine's thread n times over."""
    return tuple(tuple(_failure(s)) for s in stops)


def _failure(s: str) -> list[int]:
    """fail[i]: the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopScanner:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._fails = _failures(tuple(stops))
        self._states = [0] * len(stops)  # each string's prefix the text ends with

    def feed(self, piece: str, may_stop: bool = True) -> tuple[int, str] | None:
        """Feed the text's next characters. Returns the first stop string in the list that ends in them (vLLM's
        check_stop_strings' pick, wherever the others end), as (its start, counted back from the piece's end, the
        string), or None. may_stop False: a match stops nothing (the states go on past it)."""
        best: tuple[int, str] | None = None
        for j, (s, fail) in enumerate(zip(self.stops, self._fails, strict=True)):
            k, last = self._states[j], len(s)
            for i, ch in enumerate(piece):
                while k and ch != s[k]:
                    k = fail[k - 1]
                if ch == s[k]:
                    k += 1
                if k == last:
                    if may_stop:
                        # (characters from the match's start to the piece's end; a later-listed string never wins)
                        best = best or (len(piece) - (i + 1 - last), s)
                        break
                    k = fail[k - 1]
            self._states[j] = k
        return best

    @property
    def held(self) -> int:
        """The longest tail of the text that a stop string begins with (it may yet become that string)."""
        return max(self._states, default=0)
