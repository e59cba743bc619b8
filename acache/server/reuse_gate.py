"""Whether the server's automatic reuse may answer a request: only where it was seen to give the same answer.

Reusing a span's K/V computed elsewhere is exact under causal attention (vLLM's prefix caching), not under
bidirectional attention: a span reused with a few anchors recomputed can change a diffusion model's answer.
So automatic reuse (a chat's system prompt or document seen before) is earned span by span. In ``verified``
mode (the default) the first ``checks`` requests that could reuse a span under a given policy (its selector and
anchor settings and the request's decoding: the fields of :func:`policy_key`) are answered
without reuse while the same request with reuse runs beside them; the span is trusted under that policy only
once every one of them gave the same tokens, and refused (always recomputed) at the first that did not. The
checks must be of different requests (another prompt, or another seed where the seed changes the answer; the
server says which, ``request``): one request sent again is no new evidence, so it is recomputed, not checked
again. Trust stays evidence from those requests, not a proof for
every other one: the audits below are what catches a later request it does not hold for. Every
``audit_every``-th request served from a trusted span is checked again the same way, and a mismatch revokes
the trust. At most ``checks`` checks of a span run at once: the rest of a burst is recomputed meanwhile. A
request answered during a check gets exactly its answer without reuse. ``on`` reuses at once (the old
behaviour, for models measured exact enough elsewhere); ``off`` never reuses automatically.

Only deterministic requests can be checked (temperature 0, or a seed): a sampled request without a seed
reuses a trusted span and otherwise recomputes. A request asking for logprobs recomputes (its logprobs are
estimated over the full context, so its tokens come from that computation too).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum

from acache.sampling_params import SamplingParams

AUTO_REUSE_MODES = ("verified", "on", "off")


class Decision(str, Enum):
    REUSE = "reused"  # answered with reuse
    CHECK = "checking"  # answered without reuse; the same request with reuse runs beside it
    RECOMPUTE = "recomputed"  # answered without reuse


@dataclass
class SpanRecord:
    #: the requests checked, or being checked, before the span was trusted: each counts once
    requests: set = field(default_factory=set)
    checks: int = 0
    mismatches: int = 0
    served: int = 0  # requests answered with reuse since the span was trusted
    pending: int = 0  # checks started and not yet recorded
    audit_owed: bool = False  # an audit fell due when none could run: the next request that can be is audited
    trusted: bool = False
    refused: bool = False

    @property
    def state(self) -> str:
        return "refused" if self.refused else "trusted" if self.trusted else f"checked {self.checks}"


@dataclass(frozen=True)
class Plan:
    decision: Decision
    key: tuple
    reason: str
    request: Hashable = None  # the request a check is of (ReuseGate.plan)


def policy_key(span_keys: tuple[str, ...], params: SamplingParams) -> tuple:
    """What a check vouches for: these spans, reused with these anchors (selector, ratio, pass, depth, query,
    probe step), on a canvas decoded the same way (length, blocks, steps, commit rule, temperature, cache, refresh
    interval, FOCUS and far-mask pruning) and as far (the tokens that end it: EOS unless ``ignore_eos``, and
    ``stop_token_ids``). A diffusion model fills the whole generation region at once, so reuse that leaves a
    two-column answer unchanged can still change the same question's four-column one (docs/accuracy.md, "Answers
    given room"). The seed is not part of it: a check at one seed vouches for the reuse, not for one draw. Nor are
    ``max_tokens`` below the region and stop strings: a check compares the whole region (:class:`Check`)."""
    return (span_keys, params.selector, params.anchor_ratio, params.resolved_anchor_pass, params.resolved_anchor_depth,
            params.anchor_query, params.probe_step, params.gen_length, params.block_length, params.steps,
            params.remasking, params.threshold, params.factor, params.temperature, params.cache,
            params.refresh_interval, params.far_mask_window, params.focus_layers, params.focus_ratio,
            params.ignore_eos, tuple(sorted(set(params.stop_token_ids))))


class ReuseGate:
    """Per (spans, policy) records of how automatic reuse compared with recomputation; thread-safe.

    At most ``max_tracked`` records are kept, and apart from them at most ``max_tracked`` refusals. A record with
    a check running is never forgotten; the others give way least recently used first (forgetting one only means
    checking it again). Refusals give way oldest first, to other refusals only: a span whose refusal is forgotten
    is checked again from the start, as a new one (it was kept for good, and a client sending one mismatching
    request under ever new settings could fill the gate with refusals, so that no span was checked again). A key
    met while every record has a check running is not tracked, and its request recomputes. A request that could
    not be checked (sampled, without a seed) makes no record."""

    def __init__(self, mode: str = "verified", checks: int = 4, audit_every: int = 16,
                 max_tracked: int = 65536) -> None:
        if mode not in AUTO_REUSE_MODES:
            raise ValueError(f"auto reuse mode must be one of {', '.join(AUTO_REUSE_MODES)}, got {mode!r}")
        for name, value, low in (("checks", checks, 1), ("audit_every", audit_every, 0),
                                 ("max_tracked", max_tracked, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.mode, self.checks, self.audit_every, self.max_tracked = mode, checks, audit_every, max_tracked
        self._records: OrderedDict[tuple, SpanRecord] = OrderedDict()  # not refused, least recently used first
        self._refused: OrderedDict[tuple, SpanRecord] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.totals = {"checks": 0, "mismatches": 0}

    def plan(self, span_keys: tuple[str, ...], params: SamplingParams, deterministic: bool,
             wants_logprobs: bool, request: Hashable = None) -> Plan:
        """How to answer a request whose automatic candidates ``span_keys`` could be reused with ``params``;
        ``request`` tells requests apart (its whole prompt and seed): a check counts once a request."""
        key = policy_key(span_keys, params)
        if self.mode == "off":
            return Plan(Decision.RECOMPUTE, key, "automatic reuse is off on this server")
        if wants_logprobs:
            return Plan(Decision.RECOMPUTE, key, "logprobs are estimated without reuse, so the tokens are too")
        if self.mode == "on":
            return Plan(Decision.REUSE, key, "automatic reuse is on, unchecked")
        with self._lock:
            if key in self._refused:
                return Plan(Decision.RECOMPUTE, key, "reuse changed an answer for this span and policy")
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            if record is not None and record.trusted:
                if self.audit_every and (record.served + 1) % self.audit_every == 0:
                    record.audit_owed = True
                if not (record.audit_owed and deterministic and record.pending == 0):
                    record.served += 1
                    return Plan(Decision.REUSE, key, f"trusted after {record.checks} matching checks")
                record.audit_owed = False
                record.pending += 1
                return Plan(Decision.CHECK, key, "an audit of a trusted span")
            if not deterministic:
                return Plan(Decision.RECOMPUTE, key, "a sampled request without a seed cannot be checked")
            if record is None:
                if not self._make_room():
                    return Plan(Decision.RECOMPUTE, key, f"not checked: the gate tracks {self.max_tracked} spans, "
                                                         "each being checked")
                record = self._records[key] = SpanRecord()
            if request is not None and request in record.requests:
                return Plan(Decision.RECOMPUTE, key, "this request was checked already: trust needs other requests")
            if record.checks + record.pending >= self.checks:  # a burst runs no more checks than it needs
                return Plan(Decision.RECOMPUTE, key, f"{record.pending} checks of this span are still running")
            record.pending += 1
            if request is not None:
                record.requests.add(request)
            return Plan(Decision.CHECK, key, f"check {record.checks + record.pending} of {self.checks}",
                        request)

    def _make_room(self) -> bool:
        """Room for one more record (called under the lock): the least recently used record with no check
        running gives way; False when there is none to give."""
        if len(self._records) < self.max_tracked:
            return True
        for key, record in self._records.items():
            if record.pending == 0:
                del self._records[key]
                return True
        return False

    def record(self, key: tuple, same: bool) -> None:
        """The outcome of one check: the answer with reuse was (or was not) the answer without it."""
        with self._lock:
            self.totals["checks"] += 1
            self.totals["mismatches"] += not same
            record = self._refused.get(key) or self._records.get(key)
            if record is None:  # a check this gate did not plan (a planned one's record is never let go): kept
                record = self._records[key] = SpanRecord(pending=1)  # past max_tracked, as a refusal must be
            record.pending = max(0, record.pending - 1)
            record.checks += 1
            if not same:
                record.mismatches += 1
                record.trusted, record.refused = False, True
                self._records.pop(key, None)
                self._refused[key] = record
                self._refused.move_to_end(key)
                # the oldest refusals give way, never one with a check still running (its outcome must find it) nor
                # this one: past the bound until those checks land, if they are all that is older
                idle = [k for k, r in self._refused.items() if r.pending == 0 and k != key]
                for old in idle[:max(0, len(self._refused) - self.max_tracked)]:
                    del self._refused[old]
            elif not record.refused and record.checks >= self.checks:
                record.trusted = True
            if record.trusted:
                record.served += 1  # an audit counts as a use: the next audit is a full period later

    def drop(self, key: tuple, request: Hashable = None) -> None:
        """A check that ended without an outcome (its client went away, a request failed): ``request`` may be
        checked again."""
        with self._lock:
            record = self._refused.get(key) or self._records.get(key)
            if record is not None:
                record.pending = max(0, record.pending - 1)
                record.requests.discard(request)
                if record.trusted:  # a dropped audit counts as a use: the next falls a whole period later, not at once
                    record.served += 1

    def state(self, key: tuple) -> str:
        with self._lock:
            record = self._refused.get(key) or self._records.get(key)
            return record.state if record is not None else "unseen"

    def counts(self) -> dict[str, int]:
        """Spans by state and the checks made, for /metrics."""
        with self._lock:
            trusted = sum(r.trusted for r in self._records.values())
            return {"trusted": trusted, "refused": len(self._refused), "checking": len(self._records) - trusted,
                    **self.totals}
