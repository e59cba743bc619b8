"""Stop strings: where the text ends, which token ids go with it, and what a stream may send yet.

A stream never takes text back: it holds back the tail that could still be the start of a stop string
(or an incomplete character), and sends it once a later block shows it is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if not stop:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters a stream must not send yet: the longest suffix that is a proper prefix
    of a stop string, or an incomplete character (U+FFFD at the end) that the next token may complete."""
    whole = text.rstrip("\ufffd")  # a stop string's start before an incomplete character is held back with it
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(whole)), 0, -1):
            if whole.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold + len(text) - len(whole)


@dataclass
class Cut:
    text: str
    token_ids: list[int]
    stopped: bool  # a stop string ended the text


def cut_at_stop(ids: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> Cut:
    """The text up to the first stop string, and the fewest tokens that spell it up to its last character that is
    not a space: a token the stop string begins inside stays (``'.\\n'`` with the stop ``'\\n'``: its ``'.'`` is
    in the text), as vLLM keeps it, while one that only adds the space a decoder puts between words goes. Found by
    bisection (each try decodes a prefix), not by decoding every prefix, which took seconds at 4k tokens on the
    event loop."""
    text = decode(ids)
    at = find_stop(text, stops)
    if at is None:
        return Cut(text, list(ids), False)
    target = len(text[:at].rstrip())
    low, high = 0, len(ids)  # ids[:low] spell fewer than ``target`` characters, ids[:high] at least as many
    if target == 0:
        high = 0
    while high - low > 1:
        mid = (low + high) // 2
        if len(decode(ids[:mid]).rstrip("\ufffd")) < target:  # a character cut in its bytes is not spelled yet
            low = mid
        else:
            high = mid
    return Cut(text[:at], list(ids[:high]), True)


def spelled(ids: Sequence[int], decode: Callable[[list[int]], str], text: str, known: int = 0) -> int:
    """How many of ``ids`` a stream has sent once it has sent ``text``: a count ``n`` whose ``decode(ids[:n])``
    begins ``text``, found by bisection from ``known`` (a count already found for a shorter ``text``), and the fewest
    that spell what they spell, as :func:`cut_at_stop` keeps them (a token that decodes to nothing, a special one
    say, waits: a stop string after it would drop it). A token whose characters are only partly sent (a stop string
    may begin inside it, or its bytes end a character another token completes) waits for a later event."""
    low, high = known, len(ids) + 1  # text.startswith(decode(ids[:low])); ``high`` not yet shown to
    while high - low > 1:
        mid = (low + high) // 2
        if text.startswith(decode(list(ids[:mid]))):
            low = mid
        else:
            high = mid
    spelt = decode(list(ids[:low]))
    while low > known and decode(list(ids[:low - 1])) == spelt:
        low -= 1
    return low

