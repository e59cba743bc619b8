"""Chat messages to affix prompts: chosen messages (system prompt, few-shot turns, documents) become
affixes, rendered through the model's own chat template."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from acache.affix.prompt import GEN, Affix, AffixPrompt, Segment, resolve_segments


def chat_segments(messages: list[dict[str, str]], render: Callable[[list[dict[str, str]], bool], str],
                  affix_messages: Iterable[int] | None = None, split_before: Iterable[int] = (),
                  encode: Callable[[str], list[int]] | None = None) -> list[Segment]:
    """Splits the rendered conversation at message boundaries; consecutive chosen messages form one affix
    (a new one starts at each index of ``split_before``). With ``encode`` such an affix is the concatenation of
    its messages' own encodings: the ids each message has when no message is chosen (a tokenizer may encode two
    texts joined otherwise than one after the other), so choosing messages never changes the prompt's ids.

    ``render(messages, add_generation_prompt)`` is the chat template. The template must render each
    conversation as an extension of its shorter prefixes (Llama- and Qwen-style templates do); if it
    does not, the messages cannot be cut into reusable spans and a ValueError says so.
    """
    messages = template_messages(messages)
    if affix_messages is not None and (isinstance(affix_messages, (str, bytes)) or
                                       not isinstance(affix_messages, Iterable)):
        raise ValueError(f"affix_messages is a list of message indices, got {affix_messages!r}")
    chosen = set(affix_messages) if affix_messages is not None else {
        i for i, m in enumerate(messages) if m.get("role") == "system"}
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(messages)]
    if bad:
        raise ValueError(f"affix message index {bad[0]!r} is not a message index (0..{len(messages) - 1})")
    *pieces, generation_prompt = _pieces(messages, render)
    segments: list[Segment] = []
    run: list[str] = []
    names: list[str] = []
    splits = set(split_before)

    def close() -> None:
        name = "+".join(names)
        if encode is None:
            segments.append(Affix("".join(run), name=name))
        else:
            ids = [t for piece in run for t in encode(piece)]
            segments.append(Affix(token_ids=ids, name=name) if ids else "")
        run.clear()
        names.clear()

    for i, piece in enumerate(pieces):
        if i in splits and run:
            close()
        if i in chosen:
            run.append(piece)
            names.append(messages[i].get("role", "message"))
            continue
        if run:
            close()
        segments.append(piece)
    if run:
        close()
    segments.append(generation_prompt)
    segments.append(GEN)
    return [s for s in segments if s != ""]


def message_pieces(messages: list[dict[str, str]], render: Callable[[list[dict[str, str]], bool], str]) -> list[str]:
    """The rendered conversation cut at message boundaries: each message's text, then the generation prompt. A
    chat's prompt encodes each piece by itself, so anything that counts its tokens must too."""
    return _pieces(template_messages(messages), render)


def _pieces(messages: list[dict[str, str]], render: Callable[[list[dict[str, str]], bool], str]) -> list[str]:
    """:func:`message_pieces` of messages :func:`template_messages` has read already."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    pieces, previous = [], ""
    for k in range(1, len(messages) + 1):
        text = render(messages[:k], False)
        if not text.startswith(previous):
            raise ValueError("the chat template does not render a conversation as an extension of its first "
                             f"{k - 1} messages, so its messages cannot be cut into affixes")
        pieces.append(text[len(previous):])
        previous = text
    full = render(messages, True)
    if not full.startswith(previous):
        raise ValueError("the chat template's generation prompt does not extend the conversation")
    return [*pieces, full[len(previous):]]


def chat_prompt(messages: list[dict[str, str]], render: Callable[[list[dict[str, str]], bool], str],
                encode: Callable[[str], list[int]], affix_messages: Iterable[int] | None = None) -> AffixPrompt:
    return resolve_segments(chat_segments(messages, render, affix_messages, encode=encode), encode)


def template_messages(messages: object) -> list[dict[str, str]]:
    """Messages as a chat template reads them, in OpenAI's forms as the server takes them: a content list's text
    parts joined, ``developer`` as ``system``, other keys (``name``) kept. Offline and served chats read them through
    this one rule; a ValueError names the first message that is not one."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ValueError(f"message {i}: 'role' must be a string, got {role!r}")
        if isinstance(content, list):
            if any(not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise ValueError(f"message {i}: a content list holds text parts ({{'type': 'text', 'text': ...}}) "
                                 "only")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"message {i}: 'content' must be text or a list of text parts, got "
                             f"{type(content).__name__}")
        out.append({**m, "role": "system" if role == "developer" else role, "content": content})
    return out
