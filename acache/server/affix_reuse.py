"""Which spans of a request become shared affixes, with no change on the client's side.

Candidates in a chat: the messages before the last user message (system prompt and few-shot turns,
merged into one span) and every user message of at least ``min_document_tokens`` tokens (a pasted
document). A candidate becomes an affix the second time its exact tokens are seen: a span seen once is
not worth a shared copy, one seen again is; one the engine already holds (a restart with
``--affix-cache-dir``) is one at once. Affixes registered with ``POST /v1/affixes`` are affixes from
their first use. Whether an automatic affix may then answer a request is the reuse gate's call
(:mod:`acache.server.reuse_gate`): becoming an affix makes a span a candidate for reuse, not reused.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable

from acache.affix.chat import chat_segments
from acache.affix.prompt import GEN, Affix, AffixPrompt, Segment, affix_key, resolve_segments
from acache.inputs import InputProcessor

AFFIX_MARKER = "<|affix|>"  # where an infix completion places its registered affix


class AffixRegistry:
    """Explicitly registered affixes, by id. An id is the hash of what was registered (the tokens, and the
    messages for a chat affix), so registering the same content again returns the same id and no client
    can overwrite another's entry; the registry keeps at most ``max_bytes``, least recently used first out."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the affix registry needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._by_id: OrderedDict[str, tuple[tuple[int, ...], list[dict] | None, str | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, token_ids: list[int], messages: list[dict] | None, name: str | None) -> str:
        if not token_ids:
            raise ValueError("an affix must not be empty")
        described = json.dumps({"tokens": list(token_ids), "messages": messages}, sort_keys=True)
        affix_id = "affix-" + hashlib.sha256(described.encode()).hexdigest()[:24]
        size = 8 * len(token_ids) + len(described) + len(name or "")
        if size > self.max_bytes:
            raise ValueError(f"the affix takes {size} bytes, more than the registry's {self.max_bytes}")
        with self._lock:
            if affix_id in self._by_id:
                self._by_id.move_to_end(affix_id)
                return affix_id
            self._by_id[affix_id] = (tuple(token_ids), messages, name, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (*_, dropped) = self._by_id.popitem(last=False)
                self.nbytes -= dropped
        return affix_id

    def get(self, affix_id: str) -> tuple[tuple[int, ...], list[dict] | None, str | None]:
        with self._lock:
            if affix_id not in self._by_id:
                raise ValueError(f"unknown affix id {affix_id!r}; register one with POST /v1/affixes")
            self._by_id.move_to_end(affix_id)
            ids, messages, name, _ = self._by_id[affix_id]
            return ids, messages, name

    def __len__(self) -> int:
        return len(self._by_id)


class AutoAffixer:
    """``held(ids)``: the engine already holds this affix. ``listeners`` hear of every candidate seen, by
    content hash and length (a cluster's router sends the next request with that span to the replica that
    saw it, so that the second sighting, which makes it an affix, happens there)."""

    def __init__(self, inputs: InputProcessor, held: Callable[[tuple[int, ...]], bool] = lambda ids: False,
                 min_document_tokens: int = 128, max_tracked: int = 65536) -> None:
        self.inputs = inputs
        self.held = held
        self.min_document_tokens = min_document_tokens
        self.max_tracked = max_tracked
        self.listeners: list[Callable[[str, int], None]] = []
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _seen_before(self, ids: list[int]) -> bool:
        key = affix_key(ids)
        with self._lock:
            count = self._seen.pop(key, 0) + 1
            self._seen[key] = count
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        for listener in self.listeners:
            listener(key, len(ids))
        return count >= 2

    def _encode(self, text: str) -> list[int]:
        return self.inputs.encode_text(text)

    def chat_candidates(self, messages: list[dict], reuse: bool, registered: int = 0) -> list[Segment]:
        """The chat through the model's template with every candidate span as an :class:`Affix` of token ids:
        the messages before the last user message, every long user message, and the first ``registered``
        messages (a registered affix, an affix of its own)."""
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages))
        candidates = set(range(last_user)) | set(range(registered))
        for i, m in enumerate(messages):
            if m["role"] == "user" and len(self._encode(m["content"])) >= self.min_document_tokens:
                candidates.add(i)
        chosen = sorted(candidates) if reuse else []
        segments = chat_segments(messages, self.inputs.render_chat, chosen,
                                 split_before=[registered] if registered else [])
        return [Affix(token_ids=self._encode(seg.text), name=seg.name) if isinstance(seg, Affix) else seg
                for seg in segments]

    def chat_prompt(self, messages: list[dict], reuse: bool, registered: int = 0) -> AffixPrompt:
        """The chat's candidates that were seen before (or registered, or held) kept as affixes."""
        kept = []
        for n, seg in enumerate(self.chat_candidates(messages, reuse, registered)):
            if isinstance(seg, Affix):
                ids = list(seg.token_ids)
                forced = (registered and n == 0) or self.held(tuple(ids))
                if not (forced or self._seen_before(ids)):
                    seg = ids
            kept.append(seg)
        return resolve_segments(kept, self._encode)

    def completion_prompt(self, prompt: str | list[int], affix: tuple[int, ...] | None, name: str | None,
                          layout: str) -> AffixPrompt:
        """The affix before the prompt (prefix), after the generation region (suffix), or in place of the
        prompt's one ``AFFIX_MARKER`` (infix)."""
        if layout == "infix":
            if affix is None:
                raise ValueError("affix_layout 'infix' places a registered affix: pass 'affix' too")
            if not isinstance(prompt, str) or prompt.count(AFFIX_MARKER) != 1:
                raise ValueError(f"affix_layout 'infix' needs a text prompt holding {AFFIX_MARKER!r} exactly once, "
                                 "where the affix goes")
        body = self._encode(prompt) if isinstance(prompt, str) and layout != "infix" else prompt
        if affix is None:
            return AffixPrompt(tuple(body), len(body))
        segment = Affix(token_ids=affix, name=name)
        if layout == "infix":
            before, after = prompt.split(AFFIX_MARKER)
            segments = [before, segment, after, GEN]
        else:
            segments = [segment, list(body), GEN] if layout == "prefix" else [list(body), GEN, segment]
        return resolve_segments(segments, self._encode)
