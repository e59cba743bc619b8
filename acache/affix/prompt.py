"""Prompts whose shared spans (affixes) may sit anywhere: before, around or after the generation region.

A prompt is written as segments — text, token ids, :class:`Affix` objects and the :data:`GEN` marker
— and resolved with the model's tokenizer into an :class:`AffixPrompt`: the prompt's token ids, where
the generation region is inserted, and the affix spans. Layouts of the paper:

* prefix ``[affix][question][GEN]``
* infix ``[question head][affix][answer prompt][GEN]``
* suffix / infill ``[question][GEN][affix]``
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from acache.decoding.canvas import Layout
from acache.policies import LAYOUTS


def as_token_ids(values: Iterable, what: str = "token id") -> tuple[int, ...]:
    """Token ids as Python ints: any integer type (numpy's, a 0-d integer tensor) taken, anything else (a float, a
    string, a bool) named in a ValueError rather than truncated or parsed."""
    out = []
    for t in values:
        if isinstance(t, (bool, np.bool_)) or getattr(t, "dtype", None) == torch.bool:
            raise ValueError(f"{what} {t!r} is a bool, not an integer")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{what} {t!r} is not an integer") from None
    return tuple(out)


def affix_key(token_ids: Sequence[int]) -> str:
    """Content hash of an affix's token ids (sha256 of their int64 bytes)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


@dataclass(frozen=True)
class Affix:
    """A shared span, given as text (tokenized by the model's tokenizer) or as token ids."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("an Affix takes exactly one of text or token_ids")
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", as_token_ids(self.token_ids, "affix token id"))
            if not self.token_ids:
                raise ValueError(f"affix {self.name or ''} is empty: it has no tokens".replace("  ", " "))
        elif not self.text:
            raise ValueError(f"affix {self.name or ''} is empty: its text is ''".replace("  ", " "))


class _Gen:
    """Marks where the generation region goes in a segment list."""

    def __repr__(self) -> str:
        return "GEN"


GEN = _Gen()

Segment = str | Sequence[int] | Affix | _Gen


@dataclass(frozen=True)
class AffixSpan:
    start: int  # index in the prompt's token ids (generation region excluded)
    end: int
    key: str
    name: str | None = None

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class AffixPrompt:
    """A resolved prompt: token ids, the index where the generation region goes, and affix spans."""

    token_ids: tuple[int, ...]
    gen_at: int
    affixes: tuple[AffixSpan, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", as_token_ids(self.token_ids, "prompt token id"))
        n = len(self.token_ids)
        (gen_at,) = as_token_ids([self.gen_at], "the generation region index")
        object.__setattr__(self, "gen_at", gen_at)
        if not 0 <= self.gen_at <= n:
            raise ValueError(f"generation region index {self.gen_at} is outside the prompt of {n} tokens")
        spans = sorted(self.affixes, key=lambda a: a.start)
        for a in spans:
            label = f"affix {a.name!r}" if a.name else f"affix at [{a.start}, {a.end})"
            if a.end <= a.start:
                raise ValueError(f"{label} is empty")
            if a.start < 0 or a.end > n:
                raise ValueError(f"{label} lies outside the prompt of {n} tokens")
            if a.start < self.gen_at < a.end:
                raise ValueError(f"the generation region (at token {self.gen_at}) is inside {label}")
            if a.key != affix_key(self.token_ids[a.start:a.end]):
                raise ValueError(f"{label}: its key does not hash its token ids")
        for a, b in zip(spans, spans[1:], strict=False):
            if b.start < a.end:
                raise ValueError(f"overlapping affix spans [{a.start}, {a.end}) and [{b.start}, {b.end})")
        object.__setattr__(self, "affixes", tuple(spans))

    @classmethod
    def from_spans(cls, token_ids: Sequence[int], gen_at: int | None = None,
                   affixes: Sequence[tuple[int, int] | tuple[int, int, str]] = ()) -> AffixPrompt:
        """Marks ``[start, end)`` spans of ``token_ids`` as affixes (optionally named)."""
        ids = as_token_ids(token_ids, "prompt token id")
        spans = []
        for span in affixes:
            start, end = int(span[0]), int(span[1])
            name = span[2] if len(span) > 2 else None
            spans.append(AffixSpan(start, end, affix_key(ids[max(start, 0):max(end, 0)]), name))
        return cls(ids, len(ids) if gen_at is None else gen_at, tuple(spans))

    def check_fits(self, vocab_size: int, context: int, gen_length: int, label: str = "prompt") -> None:
        """Raises a ValueError naming the problem when the request cannot run on a model."""
        if any(isinstance(t, bool) or not 0 <= t < vocab_size for t in self.token_ids):
            bad = next(t for t in self.token_ids if isinstance(t, bool) or not 0 <= t < vocab_size)
            raise ValueError(f"{label} token id {bad!r} is not in the model's vocabulary of {vocab_size}")
        for span in self.affixes:
            if span.length > context:
                raise ValueError(f"affix {span.name or span.key[:12]!r} of {label} has {span.length} tokens, "
                                 f"more than the context of {context} (max_model_len, or the model's own)")
        if len(self.token_ids) + gen_length > context:
            raise ValueError(f"{label} is too long: {len(self.token_ids)} tokens plus gen_length {gen_length} "
                             f"exceed the context of {context} (max_model_len, or the model's own)")

    @property
    def layout(self) -> Layout:
        return Layout(self.token_ids, self.gen_at)

    def affix_ids(self, span: AffixSpan) -> tuple[int, ...]:
        return self.token_ids[span.start:span.end]


def resolve_segments(segments: Sequence[Segment], encode: Callable[[str], list[int]]) -> AffixPrompt:
    """Turns a segment list into an :class:`AffixPrompt`; the generation region defaults to the end."""
    ids: list[int] = []
    spans: list[AffixSpan] = []
    gen_at = None
    for seg in segments:
        if isinstance(seg, _Gen):
            if gen_at is not None:
                raise ValueError("a prompt has one generation region; GEN appears twice")
            gen_at = len(ids)
        elif isinstance(seg, Affix):
            tokens = list(seg.token_ids) if seg.token_ids is not None else encode(seg.text)
            if not tokens:
                raise ValueError(f"affix {seg.name!r} is empty after tokenization")
            spans.append(AffixSpan(len(ids), len(ids) + len(tokens), affix_key(tokens), seg.name))
            ids.extend(tokens)
        elif isinstance(seg, str):
            ids.extend(encode(seg) if seg else [])
        elif isinstance(seg, Sequence):
            ids.extend(seg)  # taken as integers, or named, by AffixPrompt
        else:
            raise TypeError(f"a prompt segment must be text, token ids, an Affix or GEN, got {type(seg).__name__}")
    return AffixPrompt(tuple(ids), len(ids) if gen_at is None else gen_at, tuple(spans))



def layout_segments(layout: str, affix: Affix, question: str | Sequence[int],
                    answer_prompt: str | Sequence[int] = "") -> list[Segment]:
    """The paper's three placements: prefix ``[affix][question][GEN]``, infix
    ``[question][affix][answer prompt][GEN]``, suffix ``[question][GEN][affix]``."""
    if layout == "prefix":
        return [affix, question, answer_prompt, GEN]
    if layout == "infix":
        return [question, affix, answer_prompt, GEN]
    if layout == "suffix":
        return [question, answer_prompt, GEN, affix]
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
