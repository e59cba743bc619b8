"""Which replica holds which affix, kept from the replicas' own events (stored, evicted, seen) rather than
inferred from where requests were sent, and each replica's affix hit counts. One instance runs as a named
Ray actor that every replica reports to and the router reads."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass

EVENT_KINDS = ("stored", "evicted", "seen")


@dataclass(frozen=True)
class Holding:
    """What one replica holds of a request's spans: tokens in stored affixes, tokens only seen there (a
    candidate becomes an affix on its second sighting), and all the affix tokens it holds."""

    held: int = 0
    seen: int = 0
    total: int = 0


class AffixDirectory:
    """``max_seen`` bounds the sightings kept (least recent out); stored affixes are bounded by the replicas'
    own caches, whose evictions arrive as events."""

    def __init__(self, max_seen: int = 65536) -> None:
        self.max_seen = max_seen
        self.reset()

    def reset(self) -> None:
        """Forgets every replica: an application starting anew has none yet, whatever an earlier run left here."""
        self.held: dict[str, dict[str, int]] = defaultdict(dict)  # key -> replica -> tokens
        self.totals: dict[str, int] = defaultdict(int)  # replica -> affix tokens held
        self.seen: OrderedDict[tuple[str, str], int] = OrderedDict()  # (key, replica) -> tokens
        self.stats: dict[str, dict[str, int]] = {}
        self.known: set[str] = set()  # replicas whose full report this instance holds
        self.gone: OrderedDict[str, None] = OrderedDict()  # replicas forgotten: their late reports are ignored

    def report(self, replica: str, events: list[tuple[str, str, int]], stats: dict[str, int] | None = None,
               full: bool = False) -> bool:
        """Applies a replica's events in order; ``stats`` (its cumulative affix hits and queries) replaces
        the last ones it sent. ``full``: the events name every affix the replica holds now (its first report, or
        one after a report was lost), replacing what the directory had of it. Returns whether the directory knows
        the replica from a full report: False after the directory restarted empty, so that the replica sends one."""
        if replica in self.gone:
            return True  # a late report of a replica that is gone: nothing to resend
        if full:
            self._drop_held(replica)
            self.known.add(replica)
        for kind, key, tokens in events:
            if kind not in EVENT_KINDS:
                raise ValueError(f"unknown affix event {kind!r}; expected one of {EVENT_KINDS}")
            if kind == "stored" and replica not in self.held.get(key, {}):
                self.held[key][replica] = tokens
                self.totals[replica] += tokens
            elif kind == "evicted" and replica in self.held.get(key, {}):
                self.totals[replica] -= self.held[key].pop(replica)
                if not self.held[key]:
                    del self.held[key]
            elif kind == "seen":
                self.seen.pop((key, replica), None)
                self.seen[(key, replica)] = tokens
                while len(self.seen) > self.max_seen:
                    self.seen.popitem(last=False)
        if stats is not None:
            self.stats[replica] = dict(stats)
        return replica in self.known

    def holdings(self, spans: dict[str, int], replicas: list[str],
                 in_flight: dict[str, dict[str, int]] | None = None) -> dict[str, Holding]:
        """Per replica: how many tokens of ``spans`` (key -> tokens) it holds, or will once the requests
        ``in_flight`` to it (replica -> key -> tokens, the router's own record) are admitted, how many it
        has only seen, and the affix tokens it holds in all."""
        in_flight = in_flight or {}
        out = {}
        for r in replicas:
            pending = in_flight.get(r, {})
            held = sum(t for k, t in spans.items() if r in self.held.get(k, {}) or k in pending)
            seen = sum(self.seen.get((k, r), 0) for k in spans)
            extra = sum(t for k, t in pending.items() if r not in self.held.get(k, {}))
            out[r] = Holding(held, seen, self.totals.get(r, 0) + extra)
        return out

    def forget(self, replica: str) -> None:
        """A replica that died, or that Serve replaced or removed, takes its affixes with it; a report of its that
        arrives later (reports of different replicas are not ordered) is ignored."""
        self._drop_held(replica)
        for pair in [p for p in self.seen if p[1] == replica]:
            del self.seen[pair]
        self.stats.pop(replica, None)
        self.known.discard(replica)
        self.gone[replica] = None
        while len(self.gone) > self.max_seen:
            self.gone.popitem(last=False)

    def _drop_held(self, replica: str) -> None:
        for key in [k for k, owners in self.held.items() if replica in owners]:
            del self.held[key][replica]
            if not self.held[key]:
                del self.held[key]
        self.totals.pop(replica, None)

    def snapshot(self) -> dict:
        """Per replica: affixes and tokens held, hits and queries; and the hit rate over all of them."""
        replicas = sorted(set(self.totals) | set(self.stats))
        rows = {r: {"affixes": sum(r in owners for owners in self.held.values()), "affix_tokens": self.totals.get(r, 0),
                    "affix_hits": self.stats.get(r, {}).get("hits", 0),
                    "affix_queries": self.stats.get(r, {}).get("queries", 0)} for r in replicas}
        hits = sum(row["affix_hits"] for row in rows.values())
        queries = sum(row["affix_queries"] for row in rows.values())
        return {"replicas": rows, "affix_hits": hits, "affix_queries": queries,
                "affix_hit_rate": hits / queries if queries else None}
