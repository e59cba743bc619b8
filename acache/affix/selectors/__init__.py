"""Anchor selectors, by name. Adding one is one class in one file plus a line here."""

from __future__ import annotations

from acache.affix.selectors.attention import AttentionAnchors, QueryAttentionAnchors
from acache.affix.selectors.attention_deviation import AttentionDeviationAnchors
from acache.affix.selectors.base import (
    AnchorSelector,
    admission_anchors,
    anchor_count,
    drop_uncounted,
    placed_anchor_counts,
    request_anchor_counts,
)
from acache.affix.selectors.cacheblend import CacheBlendAnchors
from acache.affix.selectors.influence import InfluenceAnchors
from acache.affix.selectors.kv_deviation import KVDeviationAnchors
from acache.affix.selectors.simple import AllAnchors, FirstK, NoAnchors, RandomAnchors
from acache.policies import QUERY_SELECTORS
from acache.policies import SELECTORS as SELECTOR_NAMES

SELECTORS: dict[str, type[AnchorSelector]] = {
    cls.name: cls for cls in (AttentionAnchors, AttentionDeviationAnchors, KVDeviationAnchors, CacheBlendAnchors,
                              InfluenceAnchors, QueryAttentionAnchors, FirstK, RandomAnchors, NoAnchors, AllAnchors)
}
if tuple(SELECTORS) != SELECTOR_NAMES:
    raise ImportError(f"acache.policies.SELECTORS {SELECTOR_NAMES} does not list the registered selectors "
                      f"{tuple(SELECTORS)}")


def make_selector(name: str, query: str = "probe") -> AnchorSelector:
    if name not in SELECTORS:
        raise ValueError(f"unknown anchor selector {name!r}; known: {', '.join(SELECTORS)}")
    if name in QUERY_SELECTORS:
        return SELECTORS[name](query)
    return SELECTORS[name]()


__all__ = ["SELECTORS", "AnchorSelector", "admission_anchors", "anchor_count", "drop_uncounted", "make_selector",
           "placed_anchor_counts", "request_anchor_counts"]
