"""Diffusion decoding: commit rules, intra-request cache policies and the one generation loop."""

from acache.decoding.cache_policy import CachePolicy, DualCache, NoCache, PrefixCache, make_cache_policy
from acache.decoding.commit import CommitRule, Factor, LowConfidence, Threshold, make_commit_rule
from acache.decoding.generate import GenerationResult, GenerationStats, generate

__all__ = [
    "CachePolicy", "CommitRule", "DualCache", "Factor", "GenerationResult", "GenerationStats", "LowConfidence",
    "NoCache", "PrefixCache", "Threshold", "generate", "make_cache_policy", "make_commit_rule",
]
