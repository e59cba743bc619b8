"""``POST /v1/affixes`` (register a span that later requests name by id) and ``POST /v1/affixes/save`` (write
the shared affixes and the registry to ``--affix-cache-dir``, so ids given out stay valid across a restart)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

from acache.affix.persistence import MANIFEST, AffixStoreError, model_fingerprint
from acache.inputs import InputProcessor
from acache.server.protocol import AffixRegistration, BadRequest
from acache.server.serving import OpenAIServing, RequestError, ServerContext

log = logging.getLogger("acache.server")


class OpenAIServingAffixes(OpenAIServing):
    """Registration and persistence of shared affixes; ``cache_dir`` is None when the server saves nothing."""

    def __init__(self, ctx: ServerContext, cache_dir: Path | None) -> None:
        super().__init__(ctx)
        self.cache_dir = cache_dir
        self.fingerprint = model_fingerprint(ctx.llm.model) if cache_dir is not None else ""
        self._saving = threading.Lock()  # one save at a time, from its snapshot to its write: never an older last

    def load(self) -> None:
        """The ids given out before a restart stay valid; a file that does not fit this model is set aside. A
        directory this server cannot write is said now, not found at shutdown with the session's affixes lost."""
        if self.cache_dir is None:
            return
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            writable = os.access(self.cache_dir, os.W_OK)
            why = "no write permission"
        except OSError as exc:
            writable, why = False, exc.strerror or str(exc)
        if not writable:
            log.warning("--affix-cache-dir %s cannot be written (%s): what it holds is read, and nothing will be "
                        "saved there (at shutdown or by POST /v1/affixes/save)", self.cache_dir, why)
        self.ctx.registry.load(self.cache_dir, self.fingerprint, self.llm.config.vocab_size)

    def save(self) -> int:
        """Writes the engine's shared affixes and the registry; returns how many affixes were saved."""
        with self._saving:
            # the engine thread is not stepping while its pages are copied off; the disk work runs beside it
            self.llm.save_affix_cache(self.cache_dir, lock=self.ctx.engine.lock)
            self.ctx.registry.save(self.cache_dir, self.fingerprint)
        return len(json.loads((self.cache_dir / MANIFEST).read_text())["entries"])

    async def save_route(self) -> dict:
        if self.cache_dir is None:
            raise BadRequest("this server has no --affix-cache-dir to save to")
        try:
            saved = await asyncio.to_thread(self.save)
        except (OSError, AffixStoreError) as exc:  # a full disk, a directory made unwritable: said to the client
            log.error("could not save the shared affixes to %s: %s", self.cache_dir, exc)
            raise RequestError(f"could not save the shared affixes to {self.cache_dir}: {exc}") from None
        return {"object": "affix_cache", "saved": saved, "path": str(self.cache_dir)}

    async def register(self, body: AffixRegistration) -> dict:
        if (body.text is None) == (body.messages is None):
            raise BadRequest("give exactly one of text or messages")
        llm = self.llm
        messages = None
        if body.text is not None:
            if not body.text.strip():
                raise BadRequest("text must not be empty")
            ids = await asyncio.to_thread(self.encode_text, body.text)
        else:
            if not body.messages:
                raise BadRequest("messages must not be empty")
            messages = [m.as_dict() for m in body.messages]
            try:
                ids = await asyncio.to_thread(leading_affix_ids, llm.inputs, messages)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        if len(ids) > llm.max_model_len:
            raise BadRequest(f"affix has {len(ids)} tokens, more than the model's context of {llm.max_model_len}")
        try:
            affix_id = self.ctx.registry.register(ids, messages, body.name)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.ctx.counters["affixes_registered_total"] += 1
        return {"id": affix_id, "object": "affix", "tokens": len(ids), "name": body.name}


def leading_affix_ids(inputs: InputProcessor, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered as the start of a conversation (what a chat will reuse)."""
    prompt = inputs.chat_prompt(messages + [{"role": "user", "content": ""}], affix_messages=range(len(messages)))
    return list(prompt.affix_ids(prompt.affixes[0]))
