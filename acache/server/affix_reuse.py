"""Which spans of a request become shared affixes, with no change on the client's side.

Candidates in a chat: the messages before the last user message (system prompt and few-shot turns,
merged into one span) and every user message of at least ``min_document_tokens`` tokens (a pasted
document). A candidate becomes an affix the second time its exact tokens are seen: a span seen once is
not worth a shared copy, one seen again is; one the engine already holds (a restart with
``--affix-cache-dir``) is reused at once. Affixes registered with ``POST /v1/affixes`` are affixes from
their first use.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

from acache.affix.chat import chat_segments
from acache.affix.prompt import GEN, Affix, AffixPrompt, affix_key, resolve_segments
from acache.llm import LLM


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
    def __init__(self, llm: LLM, min_document_tokens: int = 128, max_tracked: int = 65536) -> None:
        self.llm = llm
        self.min_document_tokens = min_document_tokens
        self.max_tracked = max_tracked
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _seen_before(self, key: str) -> bool:
        with self._lock:
            count = self._seen.pop(key, 0) + 1
            self._seen[key] = count
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
            return count >= 2

    def _held(self, ids: list[int]) -> bool:
        """The engine already holds a shared copy (loaded from --affix-cache-dir, say): reuse it at once."""
        return self.llm.engine.affixes.lookup(tuple(ids)) is not None

    def _encode(self, text: str) -> list[int]:
        return self.llm.inputs.encode_text(text)

    def chat_prompt(self, messages: list[dict], reuse: bool, registered: int = 0) -> AffixPrompt:
        """The chat through the model's template, candidates seen before marked as affixes. The first
        ``registered`` messages come from a registered affix: they form an affix of their own, always."""
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages))
        candidates = set(range(last_user)) | set(range(registered))
        for i, m in enumerate(messages):
            if m["role"] == "user" and len(self._encode(m["content"])) >= self.min_document_tokens:
                candidates.add(i)
        chosen = sorted(candidates) if reuse else []
        segments = chat_segments(messages, self.llm.inputs.render_chat, chosen,
                                 split_before=[registered] if registered else [])
        kept = []
        for n, seg in enumerate(segments):
            if isinstance(seg, Affix):
                ids = self._encode(seg.text)
                forced = (registered and n == 0) or self._held(ids)
                seg = Affix(token_ids=ids, name=seg.name) if forced or self._seen_before(affix_key(ids)) else seg.text
            kept.append(seg)
        return resolve_segments(kept, self._encode)

    def completion_prompt(self, prompt: str | list[int], affix: tuple[int, ...] | None, name: str | None,
                          layout: str) -> AffixPrompt:
        body = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        if affix is None:
            return AffixPrompt(tuple(body), len(body))
        segment = Affix(token_ids=affix, name=name)
        segments = [segment, body, GEN] if layout == "prefix" else [body, GEN, segment]
        return resolve_segments(segments, self._encode)
