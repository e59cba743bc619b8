"""Prompt segments, spans and the chat helper; bad layouts raise ValueError naming the problem."""

from __future__ import annotations

import pytest

from acache import GEN, LLM, Affix, AffixPrompt, SamplingParams
from acache.affix.chat import chat_segments
from acache.affix.prompt import affix_key, resolve_segments


def encode(text):
    return [ord(c) for c in text]


def test_segments_resolve_to_spans():
    p = resolve_segments(["Q: ", Affix("story", name="s"), "?", GEN, Affix(token_ids=[7, 8])], encode)
    assert p.token_ids == tuple(encode("Q: story?")) + (7, 8)
    assert p.gen_at == 9
    assert [(a.start, a.end, a.name) for a in p.affixes] == [(3, 8, "s"), (9, 11, None)]
    assert p.affixes[0].key == affix_key(encode("story"))
    assert resolve_segments([Affix("ab"), "c"], encode).gen_at == 3  # GEN defaults to the end


@pytest.mark.parametrize("build, message", [
    (lambda: Affix(""), "empty"),
    (lambda: Affix(token_ids=[]), "empty"),
    (lambda: Affix(), "exactly one of text or token_ids"),
    (lambda: AffixPrompt.from_spans([1, 2, 3, 4, 5], None, [(0, 3), (2, 5)]), "overlapping affix spans"),
    (lambda: AffixPrompt.from_spans([1, 2, 3, 4, 5], 2, [(0, 4, "doc")]),
     r"generation region \(at token 2\) is inside affix 'doc'"),
    (lambda: AffixPrompt.from_spans([1, 2, 3], None, [(2, 2)]), "is empty"),
    (lambda: AffixPrompt.from_spans([1, 2, 3], None, [(1, 9)]), "outside the prompt"),
    (lambda: resolve_segments([GEN, "a", GEN], encode), "GEN appears twice"),
    (lambda: resolve_segments([3.5], encode), "segment must be"),
])
def test_bad_layouts(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


def test_llm_rejects_affix_longer_than_context(llada_dir):
    llm = LLM(llada_dir)
    params = SamplingParams(gen_length=8, block_length=8, selector="attention")
    with pytest.raises(ValueError, match="more than the context"):
        llm.generate([[Affix(token_ids=[5] * 600), "q", GEN]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[Affix(token_ids=[5] * 500), "q", GEN]], SamplingParams(gen_length=16, block_length=8),
                     use_tqdm=False)


def test_affix_params_validation():
    with pytest.raises(ValueError, match="selector must be one of"):
        SamplingParams(selector="magic")
    with pytest.raises(ValueError, match="runs on the dual cache"):
        SamplingParams(selector="attention", cache="prefix")
    with pytest.raises(ValueError, match=r"anchor_ratio must be in \[0, 1\]"):
        SamplingParams(selector="attention", anchor_ratio=1.5)


def _render(msgs, add_generation_prompt):
    text = "".join(f"<{m['role']}>{m['content']}</>" for m in msgs)
    return text + ("<assistant>" if add_generation_prompt else "")


def test_chat_segments_mark_system_and_merge_consecutive_choices():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "example q"},
            {"role": "assistant", "content": "example a"}, {"role": "user", "content": "real q"}]
    segs = chat_segments(msgs, _render)
    assert segs[0] == Affix("<system>be brief</>", name="system")
    assert segs[1:] == ["<user>example q</>", "<assistant>example a</>", "<user>real q</>", "<assistant>", GEN]
    few_shot = chat_segments(msgs, _render, affix_messages=[0, 1, 2])
    assert few_shot[0] == Affix("<system>be brief</><user>example q</><assistant>example a</>",
                                name="system+user+assistant")
    with pytest.raises(ValueError, match="not a message index"):
        chat_segments(msgs, _render, affix_messages=[7])

    def unstable(msgs, add):
        return str(len(msgs)) + _render(msgs, add)

    with pytest.raises(ValueError, match="cannot be cut into affixes"):
        chat_segments(msgs, unstable)


def test_openai_message_forms_read_offline_as_the_server_reads_them(llada_dir):
    """A developer message is a system prompt and a content list its text parts joined, offline as on the server:
    offline they were an assistant turn (no affix) and a Python repr of the list. What is not a message is named."""
    from acache.server.protocol import ChatMessage

    llm = LLM(llada_dir)
    openai_forms = [{"role": "developer", "content": [{"type": "text", "text": "You are "}, {"type": "text",
                                                                                            "text": "terse."}]},
                    {"role": "user", "content": "hi", "name": "ann"}]
    plain = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi", "name": "ann"}]
    assert [ChatMessage(**m).as_dict() for m in openai_forms] == plain
    offline = llm.chat_prompt(openai_forms)
    assert offline == llm.chat_prompt(plain) and len(offline.affixes) == 1
    for bad, message in [("hi", "messages must be a list"),
                         ([{"role": "user", "content": None}], "message 0: 'content'"),
                         ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}],
                          "message 1: a content list holds text parts"),
                         ([{"content": "a"}], "message 0: 'role' must be a string"),
                         (["hi"], "message 0 must be a dict")]:
        with pytest.raises(ValueError, match=message):
            llm.chat_prompt(bad)
    with pytest.raises(ValueError, match="affix_messages is a list of message indices, got 0"):
        llm.chat_prompt(plain, affix_messages=0)


def test_llm_chat_prompt_uses_the_template(llada_dir):
    llm = LLM(llada_dir)
    p = llm.chat_prompt([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}])
    text = llm.tokenizer.decode(list(p.token_ids), skip_special_tokens=False)
    assert text == llm.tokenizer.apply_chat_template([{"role": "system", "content": "You are terse."},
                                                      {"role": "user", "content": "hi"}])
    span = p.affixes[0]
    assert llm.tokenizer.decode(list(p.affix_ids(span)), skip_special_tokens=False).endswith(
        "You are terse.<|eot_id|>")
    assert p.gen_at == len(p.token_ids)


def test_token_ids_of_any_integer_type_are_taken_and_others_named(llada_dir):
    """numpy's and torch's integers are token ids (a list of np.int64 was 'not in the vocabulary', or read as a
    batch of one-token prompts); a float, a string or a bool inside a segment used to be truncated, parsed or read
    as 1, and a float generation index failed inside torch."""
    import numpy as np
    import torch

    llm = LLM(llada_dir)
    params = SamplingParams(gen_length=4, block_length=4)
    ids = llm.tokenizer.encode("Where is Mary?", add_special_tokens=False)
    want = llm.generate([ids], params, use_tqdm=False)[0]
    for same in ([[np.int64(t) for t in ids]], [np.int32(t) for t in ids], [[torch.tensor(t) for t in ids]],
                 [[ids, GEN]], [[Affix(token_ids=[np.int64(t) for t in ids]), GEN]]):
        out = llm.generate(same, params, use_tqdm=False)
        assert len(out) == 1 and out[0].token_ids == want.token_ids and out[0].prompt_token_ids == ids
    for bad, message in [([[[*ids[:2], 86.9], GEN]], "86.9 is not an integer"),
                         ([[[*ids[:2], "0"], GEN]], "'0' is not an integer"),
                         ([[[*ids[:2], True], GEN]], "True is a bool"), ([[86.9, 0]], "86.9 is not an integer")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, params, use_tqdm=False)
    with pytest.raises(ValueError, match="generation region index 3.5 is not an integer"):
        AffixPrompt((1, 2, 3), 3.5)
    assert AffixPrompt((1, 2, 3), np.int64(2)).gen_at == 2 and type(AffixPrompt((1, 2, 3), np.int64(2)).gen_at) is int
    assert AffixPrompt.from_spans(np.array([1, 2, 3]), np.int64(2)).gen_at == 2
    # a tensor's items as a list are one prompt, as the tensor is; a bool tensor is no token id
    out = llm.generate(list(torch.tensor(ids)), params, use_tqdm=False)
    assert len(out) == 1 and out[0].token_ids == want.token_ids
    with pytest.raises(ValueError, match="is a bool"):
        llm.generate([[torch.tensor(True), *ids]], params, use_tqdm=False)
    # the engine's and the reference path's own entries name them too (they truncated 5.9 and parsed "7")
    from acache.reference import reference_generate

    for bad in ([5.9, 7], [True, 7], ["7", 5]):
        with pytest.raises(ValueError, match="is not an integer|is a bool"):
            llm.engine.add_request(bad, params)
        with pytest.raises(ValueError, match="is not an integer|is a bool"):
            reference_generate(llm.model, bad, params)
