"""Tokenizer of a checkpoint directory: ``tokenizer.json`` plus ``tokenizer_config.json`` (chat template)."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where newer checkpoints keep the template, beside the config


def token_text(value: Any) -> str | None:
    """A special token's text, whether the config stores it as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class Tokenizer:
    """Encodes, decodes, and renders chat messages with the checkpoint's own template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self._tok = tokenizer
        self.config = config or {}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}, ...]
            if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
                raise ValueError("tokenizer_config.json: chat_template must be a string or a list of "
                                 '{"name": ..., "template": "..."} objects')
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise ValueError(f"tokenizer_config.json: chat_template must be a string, got {type(template).__name__}")
        self.chat_template: str | None = template
        for key in ("bos_token", "eos_token", "mask_token"):
            value = token_text(self.config.get(key))
            if value is not None and not isinstance(value, str):
                raise ValueError(f"tokenizer_config.json: {key} must be a token's text (a string, or an object with "
                                 f"its content), got {value!r}")
        self.bos_token = token_text(self.config.get("bos_token"))
        self.eos_token = token_text(self.config.get("eos_token"))
        self.mask_token = token_text(self.config.get("mask_token"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        file = root / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"missing {TOKENIZER_FILE} in model directory {root}")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise ValueError(f"{file} could not be read as a tokenizer: {exc}") from None
        config_file = root / TOKENIZER_CONFIG_FILE
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_file} holds a {type(config).__name__}, not an object of settings")
        template_file = root / CHAT_TEMPLATE_FILE
        if template_file.is_file():  # as transformers reads it: the file's template over the config's
            try:
                config = {**config, "chat_template": template_file.read_text(encoding="utf-8")}
            except UnicodeDecodeError as exc:
                raise ValueError(f"{template_file} is not UTF-8 text: {exc}") from None
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a ValueError names the words a vocabulary without an unknown token
        cannot encode."""
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text holds a character that is not valid Unicode (a lone surrogate at index "
                             f"{exc.start})") from None
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:  # the tokenizers library raises a bare Exception
            unknown = self.unknown_words(text)
            if unknown:
                shown = ", ".join(repr(w) for w in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
                raise ValueError(f"the model's vocabulary has no token for {len(unknown)} word(s) of the text: "
                                 f"{shown}; it has no unknown token, so such text cannot be encoded") from None
            raise ValueError(f"the text could not be tokenized: {exc}") from None

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` (as the tokenizer splits them) that are not in a word-level vocabulary."""
        normalizer, pre = self._tok.normalizer, self._tok.pre_tokenizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        words = [w for w, _ in pre.pre_tokenize_str(normalized)] if pre is not None else normalized.split()
        return list(dict.fromkeys(w for w in words if self._tok.token_to_id(w) is None))

    def char_offsets(self, text: str, ids: Sequence[int]) -> list[int]:
        """Where each of ``ids`` starts in ``text``: the tokenizer's own spans where ``ids`` is what it makes of
        ``text``, else as :meth:`decode` spells them one after another (:meth:`spelled_starts`). Each offset is
        within ``text``."""
        for special in (True, False):
            encoding = self._tok.encode(text, add_special_tokens=special)
            if encoding.ids == list(ids):
                starts, end = [], 0
                for a, b in encoding.offsets:
                    starts.append(a if b > a else end)
                    end = max(end, b)
                return starts
        return [min(start, len(text)) for start in self.spelled_starts(ids)]

    def spelled_starts(self, ids: Sequence[int]) -> list[int]:
        """Where each of ``ids`` starts in the text decoding them spells: where its own text does, else past the
        space the decoder put before it. A token that spells nothing (a special token) starts where the text so
        far ends; the bytes of one character split over tokens all start where the character does.

        Each token is decoded beside the few before it, never with the whole prefix, so this is linear in
        ``len(ids)`` (decoding ever longer prefixes was quadratic: seconds at 4k tokens)."""
        starts: list[int] = []
        spelled = 0
        before: list[int] = []  # the tokens last spelled, decoded beside the next one for its spacing
        held: list[int] = []  # tokens since then that have not made a whole character yet
        for token in ids:
            prefix = self.decode(before)
            through = self.decode([*before, *held, token])
            piece = through[len(prefix):] if through.startswith(prefix) else ""
            if not piece or piece.endswith("\ufffd"):  # nothing spelled yet, or a character cut in its bytes
                starts.append(spelled + len(piece) - len(piece.lstrip()))
                if piece or self.decode([token]):  # a token that spells nothing at all leaves the window
                    held.append(token)
                continue
            # what the held tokens spelled: kept as it is (bytes that never made a character, a whole character
            # before this token's own) or completed by this token
            pending = self.decode([*before, *held])[len(prefix):] if held else ""
            whole = pending.rstrip("\ufffd")
            skip = len(pending) if piece.startswith(pending) else len(whole) if piece.startswith(whole) else 0
            own = self.decode([token])
            rest = piece[skip:]
            starts.append(spelled + len(piece) - (len(own) if own and rest.endswith(own) else len(rest.lstrip())))
            spelled += len(piece)
            before, held = [*held, token], []
        return starts

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: for a byte-level vocabulary (GPT-2's, Qwen's) its own bytes, which may be
        part of one character (its text alone then reads as the replacement character); otherwise its text's
        UTF-8."""
        piece = self._tok.id_to_token(token_id) if token_id >= 0 else None
        if piece is not None and isinstance(self._tok.decoder, decoders.ByteLevel):
            table = _byte_of_char()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Renders messages through the checkpoint's Jinja chat template, in a sandbox."""
        if not self.chat_template:
            raise ValueError(f"this tokenizer has no chat template ({TOKENIZER_CONFIG_FILE}'s chat_template or "
                             f"{CHAT_TEMPLATE_FILE})")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content'")
        # what Hugging Face's templates may use: {% break %} / {% continue %}, strftime_now, an unescaped tojson
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except (jinja2.TemplateError, TypeError) as exc:  # a TypeError: a filter or global called otherwise
            raise ValueError(f"chat template could not be rendered: {exc}") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
            sort_keys: bool = False) -> str:
    """Jinja's ``tojson`` as transformers' templates expect it: JSON as written, '<' and non-ASCII text kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary stands for: printable bytes stand for themselves, the
    others (controls, space, and the rest) were moved up to code points 256 and on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in kept}
    moved = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + moved)
            moved += 1
    return {c: b for b, c in chars.items()}
