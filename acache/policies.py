"""The names of every pluggable decoding policy, defined once for SamplingParams, the CLI and the server.

This module is a leaf: it imports nothing from the package, so any layer may import it.
"""

from __future__ import annotations

COMMIT_RULES = ("threshold", "low_confidence", "factor")
CACHE_POLICIES = ("none", "prefix", "dual")
# anchor selectors (affix/selectors registers one class under each name)
SELECTORS = ("attention", "attention-deviation", "kv-deviation", "cacheblend", "influence", "query-attention",
             "first-k", "random", "none", "all")
BICACHE_POLICIES = ("bicache-matched", "bicache-profiled")
#: every value ``selector`` takes (SamplingParams, the CLI's ``--selector``, the HTTP field): how a reused affix
#: is refreshed, by the anchors of a selector or by BiCache's depth
SELECTOR_CHOICES = (*SELECTORS, *BICACHE_POLICIES)
# where ACache's queries come from: the probe, a no-cache forward, or the probe's first layers only
ANCHOR_QUERIES = ("probe", "full", "shallow")
#: the selectors that read ``anchor_query`` (the others score without ACache's queries)
QUERY_SELECTORS = ("attention", "attention-deviation")
#: the selectors that can choose their anchors inside the request's first refresh forward (``anchor_pass="one"``):
#: they score from what that forward holds (K/V deviation, the masks' or the question's attention over the affix)
ONE_PASS_SELECTORS = ("attention", "attention-deviation", "cacheblend", "query-attention")
#: where anchors are chosen: ``one`` inside the first refresh forward, ``two`` by a selection of their own before it
ANCHOR_PASSES = ("one", "two")
#: the selector the server, the command line and the demo use when none is named
DEFAULT_SELECTOR = "attention"
#: the share of a model's layers the ``shallow`` probe runs (at least one)
SHALLOW_SHARE = 0.3
LAYOUTS = ("prefix", "infix", "suffix")
