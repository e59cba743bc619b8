"""Every field of OpenAI's completions and chat schemas: 200 with its effect, or a 400 saying why a
diffusion model cannot honour the value."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from acache import GEN, LLM, SamplingParams
from acache.server.app import create_app

Q = "where is mary ?"
STORY = "mary moved to the kitchen . john went to the garden ."


@pytest.fixture(scope="module")
def setup():
    from acache.paths import default_model

    llm = LLM(default_model(), kv_cache_memory=1 << 24)
    offline = LLM(default_model(), kv_cache_memory=1 << 24)  # the served one is stepped by the server alone
    with TestClient(create_app(llm, "tiny")) as client:
        yield client, offline


def post(client, path, body):
    resp = client.post(path, json=body)
    return resp.status_code, resp.json() if resp.headers.get("content-type", "").startswith("application/json") \
        else resp.text


NEUTRAL_OK = [("top_p", 1), ("top_p", 1.0), ("frequency_penalty", 0), ("presence_penalty", 0.0), ("logit_bias", {}),
              ("logprobs", 0), ("best_of", 1), ("echo", False), ("suffix", None), ("user", "u1"), ("n", 1),
              ("metadata", {"k": "v"}), ("store", False), ("service_tier", "auto"), ("seed", 3)]
REFUSED = [("top_p", 0.9, "nucleus sampling"), ("frequency_penalty", 0.5, "no left-to-right history"),
           ("presence_penalty", -1.0, "no left-to-right history"), ("logit_bias", {"5": 10.0}, "biasing"),
           ("best_of", 3, "one candidate"), ("n", 2, "only n=1")]
CHAT_NEUTRAL_OK = [("max_completion_tokens", 2), ("logprobs", False), ("logprobs", True), ("top_logprobs", 0),
                   ("tools", []),
                   ("tool_choice", "none"), ("parallel_tool_calls", True), ("response_format", {"type": "text"}),
                   ("modalities", ["text"])]
CHAT_REFUSED = [("top_logprobs", 2, "needs logprobs=true"), ("top_logprobs", 21, "less than or equal to 20"),
                ("tools", [{"type": "function"}], "tool calling"),
                ("response_format", {"type": "json_object"}), ("modalities", ["text", "audio"], "only text"),
                ("reasoning_effort", "high", "no reasoning mode")]


def answer_without(client, path: str, body: dict) -> list[int]:
    status, out = post(client, path, body)
    assert status == 200, out
    return out["choices"][0]["token_ids"]


@pytest.mark.parametrize("field, value", NEUTRAL_OK, ids=lambda v: str(v))
def test_completion_fields_at_their_neutral_value(setup, field, value):
    """Accepted, and changing nothing: the answer is the one without the field."""
    client, _ = setup
    body = {"prompt": f"story : {STORY} question : {Q} answer :", "max_tokens": 2}
    status, out = post(client, "/v1/completions", {**body, field: value})
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == answer_without(client, "/v1/completions", body)


@pytest.mark.parametrize("field, value, why", REFUSED, ids=lambda v: str(v))
def test_completion_fields_a_diffusion_model_cannot_honour(setup, field, value, why):
    client, _ = setup
    status, body = post(client, "/v1/completions", {"prompt": Q, "max_tokens": 2, field: value})
    assert status == 400 and field in body["error"]["message"] and why in body["error"]["message"]


@pytest.mark.parametrize("field, value", CHAT_NEUTRAL_OK, ids=lambda v: str(v))
def test_chat_fields_at_their_neutral_value(setup, field, value):
    client, _ = setup
    plain = {"messages": [{"role": "user", "content": f"story : {STORY} question : {Q}"}], "max_tokens": 2}
    body = {**plain, field: value}
    if field == "max_completion_tokens":
        del body["max_tokens"]
    status, out = post(client, "/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == answer_without(client, "/v1/chat/completions", plain)


@pytest.mark.parametrize("case", CHAT_REFUSED, ids=lambda c: c[0])
def test_chat_fields_a_diffusion_model_cannot_honour(setup, case):
    client, _ = setup
    field, value, *why = case
    status, out = post(client, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": Q}], "max_tokens": 2, field: value})
    assert status == 400 and field in out["error"]["message"]
    assert all(w in out["error"]["message"] for w in why)


def test_fields_with_an_effect(setup):
    client, llm = setup
    params = SamplingParams(gen_length=2, block_length=2)
    story = f"story : {STORY} question : {Q} answer :"
    want = llm.generate(story, params, use_tqdm=False)[0]
    # max_completion_tokens is max_tokens; developer is system; content parts are joined
    chat = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "mary moved to the kitchen . "},
                                                           {"type": "text", "text": "john went to the garden ."}]},
                         {"role": "user", "content": [{"type": "text", "text": Q}]}],
            "max_completion_tokens": 2, "selector": "off"}
    status, out = post(client, "/v1/chat/completions", chat)
    assert status == 200 and out["choices"][0]["message"]["content"] == want.text == "kitchen"
    status, out = post(client, "/v1/chat/completions", {**chat, "max_tokens": 4})
    assert status == 400 and "disagree" in out["error"]["message"]
    # echo prepends the prompt; a batch of token-id prompts is a batch
    status, out = post(client, "/v1/completions", {"prompt": story, "max_tokens": 2, "echo": True})
    assert status == 200 and out["choices"][0]["text"] == story + want.text
    ids = llm.tokenizer.encode(story)
    other = llm.tokenizer.encode(f"story : {STORY} question : where is john ? answer :")
    status, out = post(client, "/v1/completions", {"prompt": [ids, other], "max_tokens": 2})
    each = [o.token_ids for o in llm.generate([ids, other], params, use_tqdm=False)]
    assert status == 200 and [c["token_ids"] for c in out["choices"]] == each and each[0] != each[1]
    # suffix: the text after the generation region (infilling)
    status, out = post(client, "/v1/completions", {"prompt": f"question : {Q} answer :", "suffix": f"story : {STORY}",
                                                   "max_tokens": 2})
    infill = llm.generate([[f"question : {Q} answer :", GEN, f"story : {STORY}"]], params, use_tqdm=False)[0]
    assert status == 200 and out["choices"][0]["token_ids"] == infill.token_ids
    # stream_options.include_usage sends the usage chunk last
    resp = client.post("/v1/completions", json={"prompt": story, "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    usage = json.loads(events[-2])
    assert events[-1] == "[DONE]" and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    status, out = post(client, "/v1/completions", {"prompt": story, "stream_options": {"include_usage": True}})
    assert status == 400 and "only allowed with stream=true" in out["error"]["message"]
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == llm.max_model_len


def test_an_affix_placed_inside_the_prompt(setup):
    """affix_layout 'infix' puts the registered affix where the prompt's one '<|affix|>' is; the answer is the
    offline path's for the same segments, and every malformed use is a 400 that says what is wrong."""
    from acache import Affix

    client, llm = setup
    story = f"story : {STORY}"
    affix = post(client, "/v1/affixes", {"text": story})[1]["id"]
    body = {"prompt": f"question : {Q} <|affix|> answer :", "affix": affix, "affix_layout": "infix", "max_tokens": 2}
    status, out = post(client, "/v1/completions", body)
    params = SamplingParams(gen_length=2, block_length=2, selector="attention")
    segments = [f"question : {Q} ", Affix(token_ids=tuple(llm.tokenizer.encode(story))), " answer :", GEN]
    want = llm.generate([segments], params, use_tqdm=False)[0]
    assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids
    for change, why in [({"prompt": f"question : {Q} answer :"}, "holding '<|affix|>' exactly once"),
                        ({"prompt": "<|affix|> <|affix|> answer :"}, "holding '<|affix|>' exactly once"),
                        ({"prompt": llm.tokenizer.encode("answer :")}, "needs a text prompt"),
                        ({"affix": None}, "pass 'affix' too")]:
        status, out = post(client, "/v1/completions", {**body, **change})
        assert status == 400 and why in out["error"]["message"], (change, out)


def test_anchor_query(setup, monkeypatch):
    """anchor_query reaches the engine's selector (the offline path's answer); without an affix it is a 400, as
    is an unknown one, each naming the field."""
    from acache import Affix
    from acache.engine import model_runner

    client, llm = setup
    asked = []
    real = model_runner.make_selector
    monkeypatch.setattr(model_runner, "make_selector", lambda name, query: asked.append((name, query)) or
                        real(name, query))
    story = f"story : {STORY}"
    affix = post(client, "/v1/affixes", {"text": story})[1]["id"]
    body = {"prompt": f"question : {Q} answer :", "affix": affix, "max_tokens": 2, "anchor_query": "shallow"}
    status, out = post(client, "/v1/completions", body)
    assert status == 200 and asked == [("attention", "shallow")]
    params = SamplingParams(gen_length=2, block_length=2, selector="attention", anchor_query="shallow")
    segments = [Affix(token_ids=tuple(llm.tokenizer.encode(story))), llm.tokenizer.encode(f"question : {Q} answer :"),
                GEN]
    want = llm.generate([segments], params, use_tqdm=False)[0]
    assert out["choices"][0]["token_ids"] == want.token_ids
    status, out = post(client, "/v1/completions", {"prompt": f"{story} question : {Q} answer :", "max_tokens": 2,
                                                   "anchor_query": "full"})
    assert status == 400 and "anchor_query applies to a reused affix" in out["error"]["message"]
    status, out = post(client, "/v1/completions", {**body, "anchor_query": "deep"})
    assert status == 400 and "anchor_query" in str(out)


def test_anchor_pass(setup, monkeypatch):
    """anchor_pass reaches the engine (the offline path's answer, a probe only for 'two'); without an affix, with a
    selector that lacks the pass, beside probe_step or unknown, it is a 400 that names it."""
    from acache import Affix
    from acache.engine import model_runner

    client, llm = setup
    story = f"story : {STORY}"
    affix = post(client, "/v1/affixes", {"text": story})[1]["id"]
    segments = [Affix(token_ids=tuple(llm.tokenizer.encode(story))), llm.tokenizer.encode(f"question : {Q} answer :"),
                GEN]
    body = {"prompt": f"question : {Q} answer :", "affix": affix, "max_tokens": 2}
    asked = []
    real = model_runner.make_selector
    monkeypatch.setattr(model_runner, "make_selector", lambda name, query: asked.append(name) or real(name, query))
    for anchor_pass in ("one", "two"):
        asked.clear()
        status, out = post(client, "/v1/completions", {**body, "anchor_pass": anchor_pass})
        assert asked == ([] if anchor_pass == "one" else ["attention"])
        want = llm.generate([segments], SamplingParams(gen_length=2, block_length=2, selector="attention",
                                                        anchor_pass=anchor_pass), use_tqdm=False)[0]
        assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids
    for change, why in [({"affix": None, "prompt": f"{story} question : {Q} answer :"},
                         "anchor_pass applies to a reused affix"),
                        ({"selector": "kv-deviation"}, "'kv-deviation' has no one-pass form"),
                        ({"probe_step": True}, "probe_step need"),
                        ({"anchor_pass": "three"}, "anchor_pass")]:
        status, out = post(client, "/v1/completions", {**body, "anchor_pass": "one", **change})
        assert status == 400 and why in str(out), (change, out)


def test_probe_step(setup):
    """probe_step reaches the engine when an affix is reused (the offline path's answer); without an affix, or
    with a selector that has no probe, it is a 400 that names it."""
    from acache import Affix

    client, llm = setup
    story = f"story : {STORY}"
    affix = post(client, "/v1/affixes", {"text": story})[1]["id"]
    body = {"prompt": f"question : {Q} answer :", "affix": affix, "max_tokens": 2, "probe_step": True}
    status, out = post(client, "/v1/completions", body)
    params = SamplingParams(gen_length=2, block_length=2, selector="attention", probe_step=True)
    segments = [Affix(token_ids=tuple(llm.tokenizer.encode(story))), llm.tokenizer.encode(f"question : {Q} answer :"),
                GEN]
    want = llm.generate([segments], params, use_tqdm=False)[0]
    assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids
    status, out = post(client, "/v1/completions", {"prompt": f"{story} question : {Q} answer :", "max_tokens": 2,
                                                   "probe_step": True})
    assert status == 400 and "probe_step applies to a reused affix" in out["error"]["message"]
    status, out = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": Q}], "max_tokens": 2,
                                                        "probe_step": True})
    assert status == 200  # a chat with no shared span yet decodes as usual
    status, out = post(client, "/v1/completions", {**body, "selector": "bicache-matched"})
    assert status == 400 and "probe_step" in out["error"]["message"] and "selector" in out["error"]["message"]
    status, out = post(client, "/v1/completions", {**body, "probe_step": "yes"})
    assert status == 400 and "probe_step" in str(out)


def test_one_model_by_id(setup):
    """``GET /v1/models/{id}`` as OpenAI's API answers it: the card of a served model, a 404 naming the others."""
    client, _ = setup
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json() == client.get("/v1/models").json()["data"][0]
    for missing in ("llama", "tiny/extra", "TINY"):
        resp = client.get(f"/v1/models/{missing}")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        assert f"model '{missing}' is not served here; this server serves 'tiny'" in resp.json()["error"]["message"]


def test_anchor_depth(setup, monkeypatch):
    """anchor_depth reaches the selecting refresh (the offline path's answer at each depth); without an affix, out of
    (0, 1], not a number, or with a selection of its own pass, it is a 400 that names it."""
    from acache import Affix
    from acache.engine import model_runner

    client, llm = setup
    depths = []
    real = model_runner.refresh_selecting

    def refresh(model, *args):
        depths.extend(args[-2])  # SelectingInputs.depths, just before ``cached``
        return real(model, *args)

    monkeypatch.setattr(model_runner, "refresh_selecting", refresh)
    story = f"story : {STORY}"
    affix = post(client, "/v1/affixes", {"text": story})[1]["id"]
    segments = [Affix(token_ids=tuple(llm.tokenizer.encode(story))), llm.tokenizer.encode(f"question : {Q} answer :"),
                GEN]
    body = {"prompt": f"question : {Q} answer :", "affix": affix, "max_tokens": 2, "anchor_ratio": 0.3}
    for depth in (0.25, 1.0):
        depths.clear()
        status, out = post(client, "/v1/completions", {**body, "anchor_depth": depth})
        assert depths == [depth]
        want = llm.generate([segments], SamplingParams(gen_length=2, block_length=2, selector="attention",
                                                        anchor_ratio=0.3, anchor_depth=depth), use_tqdm=False)[0]
        assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids
    for change, why in [({"affix": None, "prompt": f"{story} question : {Q} answer :"},
                         "anchor_depth applies to a reused affix"),
                        ({"anchor_depth": 0}, "anchor_depth"), ({"anchor_depth": 1.5}, "anchor_depth"),
                        ({"anchor_depth": "half"}, "anchor_depth"), ({"anchor_depth": True}, "anchor_depth"),
                        ({"selector": "kv-deviation"}, "needs anchor_pass 'one'"),
                        ({"anchor_pass": "two"}, "needs anchor_pass 'one'")]:
        status, out = post(client, "/v1/completions", {**body, "anchor_depth": 0.5, **change})
        assert status == 400 and why in str(out), (change, out)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": Q, "max_tokens": 2}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": Q}],
                                                                  "max_tokens": 2})])
def test_a_model_not_served_is_404_as_openai_answers_it(setup, path, body):
    """The openai client raises NotFoundError for it, as for ``GET /v1/models/{id}``; it was a 400."""
    client, _ = setup
    resp = client.post(path, json={**body, "model": "gpt-4"})
    err = resp.json()["error"]
    assert resp.status_code == 404 and err["code"] == "model_not_found" and err["type"] == "not_found_error"
    assert "model 'gpt-4' is not served here; this server serves 'tiny'" in err["message"]


@pytest.mark.parametrize("field", ["stream", "n"])
def test_null_stream_and_n_are_their_defaults(setup, field):
    """OpenAI types both as nullable and clients that write unset fields as null send them so: they were 400."""
    client, _ = setup
    body = {"prompt": Q, "max_tokens": 2}
    plain = post(client, "/v1/completions", body)[1]["choices"][0]["token_ids"]
    status, out = post(client, "/v1/completions", {**body, field: None})
    assert status == 200 and out["choices"][0]["token_ids"] == plain
    status, out = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": Q}], field: None,
                                                        "max_tokens": 2})
    assert status == 200, out


def test_stop_token_ids_end_the_answer(setup):
    """vLLM's ``stop_token_ids``: the answer ends at the first of them, as the offline path ends it."""
    client, offline = setup
    prompt = f"story : {STORY} question : {Q} answer :"
    body = {"prompt": prompt, "max_tokens": 4, "block_length": 4}
    plain = post(client, "/v1/completions", body)[1]["choices"][0]
    first = plain["token_ids"][0]
    status, out = post(client, "/v1/completions", {**body, "stop_token_ids": [first]})
    want = offline.generate(offline.tokenizer.encode(prompt), SamplingParams(
        gen_length=4, block_length=4, stop_token_ids=(first,)), use_tqdm=False)[0]
    choice = out["choices"][0]
    assert status == 200 and choice["token_ids"] == want.token_ids != plain["token_ids"]
    assert choice["finish_reason"] == "stop"
    status, out = post(client, "/v1/completions", {**body, "stop_token_ids": [-1]})
    assert status == 400 and "stop_token_ids must be non-negative" in out["error"]["message"]
    # ignore_eos decodes through the model's stops as offline, the request's own still ending it
    long = {"prompt": prompt, "max_tokens": 8, "block_length": 2}
    stopped = post(client, "/v1/completions", long)[1]["choices"][0]
    status, out = post(client, "/v1/completions", {**long, "ignore_eos": True})
    want = offline.generate(offline.tokenizer.encode(prompt), SamplingParams(
        gen_length=8, block_length=2, ignore_eos=True), use_tqdm=False)[0]
    choice = out["choices"][0]
    assert status == 200 and choice["token_ids"] == want.token_ids and len(want.token_ids) == 8
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) < 8 and choice["finish_reason"] == "length"
    status, out = post(client, "/v1/completions", {**long, "ignore_eos": True, "stop_token_ids": [first]})
    assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids[:want.token_ids.index(first)]


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory):
    """A checkpoint whose tokenizer puts a BOS before every text it encodes (as many real ones do)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from tests.conftest import tiny_checkpoint

    path = tiny_checkpoint(tmp_path_factory.mktemp("bos"), "llada")
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    bos = "<|startoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(path, kv_cache_memory=1 << 22)
    offline = LLM(path, kv_cache_memory=1 << 22)
    with TestClient(create_app(llm, "bos")) as client:
        yield client, offline, tok.token_to_id(bos)


def test_a_text_prompt_is_encoded_as_the_offline_path_encodes_it(bos_server):
    """The completions endpoint encoded a text prompt without the tokenizer's special tokens, so a BOS tokenizer's
    model got another prompt (and answer) than ``LLM.generate`` gives it. ``/tokenize`` counts the same way."""
    client, offline, bos = bos_server
    prompt, params = "Where is Mary?", SamplingParams(gen_length=8, block_length=8)
    want = offline.generate(prompt, params, use_tqdm=False)[0]
    status, out = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "block_length": 8})
    ids = offline.tokenizer.encode(prompt)
    assert ids[0] == bos and status == 200
    assert out["choices"][0]["token_ids"] == want.token_ids and out["usage"]["prompt_tokens"] == len(ids)
    assert post(client, "/tokenize", {"prompt": prompt})[1]["tokens"] == ids
    assert post(client, "/tokenize", {"prompt": prompt, "add_special_tokens": False})[1]["tokens"] == ids[1:]
    chat = post(client, "/tokenize", {"messages": [{"role": "user", "content": prompt}]})[1]["tokens"]
    assert chat[0] != bos or chat[1] != bos  # a template's own BOS is not doubled


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    from tests.conftest import tiny_checkpoint

    path = tiny_checkpoint(tmp_path_factory.mktemp("short"), "llada", max_seq_len=64)
    llm, offline = LLM(path, kv_cache_memory=1 << 22), LLM(path, kv_cache_memory=1 << 22)
    with TestClient(create_app(llm, "short")) as client:
        yield client, offline


def test_max_tokens_that_fit_the_context_are_served_when_whole_blocks_would_not(short_context):
    """A 20-token prompt in a context of 64: ``max_tokens`` 40 rounded up to whole blocks of the default 32 is 64
    and passed the context, so it was refused naming a gen_length of 64; now they are decoded in the blocks nearest
    the default whose whole number still fits (one block of 40), as the offline path decodes them; a prime 43 with
    steps 4 in blocks that fit and that 4 steps cover (two of 22)."""
    client, offline = short_context
    prompt = list(range(20, 40))
    status, out = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 40})
    want = offline.generate(prompt, SamplingParams(gen_length=40, block_length=40), use_tqdm=False)[0]
    assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids
    status, out = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 43, "steps": 4})
    # 43 in blocks of 22 (2 x 22 = 44 fits; 4 steps cover 2 blocks), not 43 of one
    want = offline.generate(prompt, SamplingParams(gen_length=44, block_length=22, steps=4), use_tqdm=False)[0]
    assert status == 200 and out["choices"][0]["token_ids"] == want.token_ids[:43]
    chat = [{"role": "user", "content": "hi"}]
    room = 64 - len(offline.chat_prompt(chat).token_ids)
    status, out = post(client, "/v1/chat/completions", {"messages": chat, "max_tokens": room})
    assert status == 200 and len(out["choices"][0]["token_ids"]) <= room, out
    status, out = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 45})  # past the context itself
    assert status == 400 and "too long" in out["error"]["message"]
    status, out = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "block_length": 32})
    assert status == 400 and "gen_length 64" in out["error"]["message"]  # blocks the client chose are kept


def test_echo_is_the_prompt_before_the_generation_region(setup):
    """With text after the generation region (the affix in the suffix layout, or ``suffix``), echo put it before
    the completion; now the echoed text is what precedes the answer."""
    client, _ = setup
    status, reg = post(client, "/v1/affixes", {"text": STORY})
    assert status == 200
    for extra, before in (({"affix_layout": "suffix"}, Q), ({"suffix": " the garden"}, f"{STORY} {Q}")):
        body = {"prompt": Q, "max_tokens": 2, "affix": reg["id"], **extra}
        status, out = post(client, "/v1/completions", {**body, "echo": True})
        plain = post(client, "/v1/completions", body)[1]["choices"][0]["text"]
        assert status == 200 and out["choices"][0]["text"] == before + plain
