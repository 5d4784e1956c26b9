"""Text and token lists that count what is copied out of them: a reply folded with += copies all it has so far for
every piece (the square of its length), one joined once copies each character once."""

from __future__ import annotations


class CountedText(str):
    copied = 0  # characters copied by + and += with a CountedText on either side, since the last reset
    before = 0  # of those, the characters of the text it was appended to (what a fold by += copies again)

    def __add__(self, other: str) -> CountedText:
        CountedText.copied += len(self) + len(other)
        CountedText.before += len(self)
        return CountedText(str.__add__(self, other))  # (counted on: what it is added to next is copied again)

    def __radd__(self, other: str) -> CountedText:  # (a plain str's + of one: str has no __add__ slot to go first)
        CountedText.copied += len(other) + len(self)
        CountedText.before += len(other)
        return CountedText(str.__add__(other, self))


class CountedIds(list):
    """A token list that counts the ids copied out of it (concatenated or sliced)."""

    copied = 0

    def __add__(self, other: list) -> list:
        CountedIds.copied += len(self) + len(other)
        return list(self) + list(other)

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice):
            CountedIds.copied += len(got)
        return got
