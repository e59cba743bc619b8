"""Automatic reuse never changes an answer unchecked: the server guide's chat (docs/guide/server.md) sent again
answers the same, a span is reused only after it gave the same answers, and the usage says what was reused and
why."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from acache import LLM, SamplingParams
from acache.paths import SHIPPED_MODEL
from acache.server.app import create_app
from acache.server.reuse_gate import Decision

STORY = "mary moved to the kitchen . john went to the garden ."


def story(*extra: str) -> str:
    """The guide's story with more sentences: each test a span no other test's engine holds yet."""
    return " ".join([STORY, *(f"{who} went to the {where} ." for who, where in extra)])


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llm():
    return LLM(SHIPPED_MODEL, page_size=8)


def served(llm, **kwargs) -> TestClient:
    return TestClient(create_app(llm, "acache-tiny", **kwargs))


def ask(client: TestClient, messages: list[dict], settle: bool = True, **fields) -> dict:
    """One chat request; with ``settle``, also waits for the check it started (its shadow request with reuse
    may end after the answer) so that the next request sees its outcome."""
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **fields})
    assert resp.status_code == 200, resp.text
    if settle:
        assert wait_for(lambda: not client.app.state.checks_running)
    return resp.json()


def plain_answer(llm, messages, **params) -> list[int]:
    params = {"gen_length": 2, "block_length": 2, **params}
    prompt = [list(llm.chat_prompt(messages, affix_messages=[]).token_ids)]
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].token_ids


def test_the_readme_chat_sent_again_answers_the_same(llm):
    """The issue's case: at ratio 0.2 reusing the story turns ``kitchen`` into ``mary``; the check sees it and
    the span is recomputed from then on."""
    messages = chat(STORY, "Where is Mary?")
    with served(llm) as client:
        answers = [ask(client, messages) for _ in range(5)]
        metrics = client.get("/metrics").text
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert texts == ["kitchen"] * 5
    assert all(a["choices"][0]["token_ids"] == plain_answer(llm, messages) for a in answers)
    decisions = [a["usage"]["affix_reuse"]["decision"] for a in answers]
    assert decisions == ["none", "checking", "recomputed", "recomputed", "recomputed"]
    assert answers[2]["usage"]["affix_reuse"]["state"] == "refused"
    assert answers[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "acache_auto_reuse_mismatches_total 1.0" in metrics and "acache_auto_reuse_refused_spans 1.0" in metrics
    # what reuse would have said, so the check had something to catch
    reused = llm.generate(llm.chat_prompt(messages), SamplingParams(gen_length=2, block_length=2,
                                                                    selector="attention"), use_tqdm=False)[0]
    assert reused.text != "kitchen"


def test_a_span_that_gives_the_same_answers_is_trusted_then_reused(llm):
    """At anchor ratio 1 reuse recomputes every affix token, so it matches: after the checks it answers."""
    system = story(("emma", "cellar"))
    messages = chat(system, "Where is John?")
    questions = ["Where is John?", "Where is Mary?", "Where is Mary?", "Where is John?", "Where is Emma?"]
    with served(llm, reuse_checks=2, reuse_audit_every=0) as client:
        answers = [ask(client, chat(system, q), anchor_ratio=1.0) for q in questions]
        after = answers[-1]
        longer = ask(client, messages, anchor_ratio=1.0, max_tokens=4)  # trust earned in 2 columns is not for 4
    decisions = [a["usage"]["affix_reuse"]["decision"] for a in answers]
    # the span is first seen with John's question (nothing to reuse yet), checked with Mary's; Mary's again is no
    # new evidence (recomputed); John's is the second check; then Emma's is answered with reuse
    assert decisions == ["none", "checking", "recomputed", "checking", "reused"]
    assert "checked already" in answers[2]["usage"]["affix_reuse"]["reason"]
    assert longer["usage"]["affix_reuse"]["decision"] == "checking"
    assert longer["choices"][0]["token_ids"] == plain_answer(llm, messages, gen_length=4, block_length=4)[:4]
    usage = after["usage"]
    assert usage["affix_reuse"]["state"] == "trusted" and usage["affix_reuse"]["anchor_ratio"] == 1.0
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # every token recomputed at ratio 1
    assert all(a["choices"][0]["token_ids"] == plain_answer(llm, chat(system, q))
               for a, q in zip(answers, questions, strict=True))


def wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_mixed_requests_arriving_apart_answer_as_without_reuse(llm):
    """Different stories, questions, lengths, ratios, temperatures and arrival times, run concurrently: every
    answer not served by reuse equals the request without reuse, token for token, and those served by reuse
    come from spans trusted under their policy (at ratio 1, where reuse recomputes everything, equal too)."""
    stories = [story(("daniel", "office")), "sandra went to the office . daniel moved to the hallway ."]
    jobs = []
    for n in range(12):
        system = stories[n % 2]
        fields = {"anchor_ratio": [0.2, 1.0, 0.5][n % 3], "max_tokens": [2, 4][n % 2]}
        if n % 4 == 3:
            fields |= {"temperature": 0.7, "seed": n}
        jobs.append((chat(system, ["Where is Mary?", "Where is Daniel?", "Where is John?"][n % 3]), fields))
    results: dict[int, dict] = {}
    with served(llm, reuse_checks=1, reuse_audit_every=0) as client:
        for messages, _ in jobs[:2]:
            ask(client, messages)  # each story seen once: the twelve may reuse them

        def run(n: int) -> None:
            time.sleep(0.05 * (n % 5))
            messages, fields = jobs[n]
            results[n] = ask(client, messages, settle=False, **fields)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for n, (messages, fields) in enumerate(jobs):
        usage = results[n]["usage"]["affix_reuse"]
        gen = fields["max_tokens"]
        params = {"gen_length": gen, "block_length": gen, "temperature": fields.get("temperature", 0.0),
                  "seed": fields.get("seed")}
        if usage["decision"] == "reused":
            assert usage["state"] == "trusted"
            if fields["anchor_ratio"] < 1.0:
                continue  # a trusted span may still change an answer: the tolerance docs/serving.md measures
        assert results[n]["choices"][0]["token_ids"] == plain_answer(llm, messages, **params)[:gen], (n, usage)


def test_logprobs_requests_decode_without_reuse_and_say_what_the_logprobs_describe(llm):
    messages = chat(story(("lucas", "garage")), "Where is Mary?")
    with served(llm, auto_reuse="on") as client:
        ask(client, messages)
        out = ask(client, messages, logprobs=True, top_logprobs=2, mc_samples=4)
        reused = ask(client, messages)
    report = out["usage"]["affix_reuse"]
    assert report["decision"] == "recomputed" and "without reuse" in report["logprobs"]
    assert out["choices"][0]["token_ids"] == plain_answer(llm, messages)
    assert reused["usage"]["affix_reuse"]["decision"] == "reused"  # mode on: unchecked reuse otherwise


def test_the_per_request_switch(llm):
    messages = chat(story(("oliver", "bedroom")), "Where is Mary?")
    with served(llm) as client:
        ask(client, messages)
        forced = ask(client, messages, affix_reuse="always")
        off = ask(client, messages, affix_reuse="off")
        bad = client.post("/v1/chat/completions", json={"messages": messages, "affix_reuse": "sometimes"})
    assert forced["usage"]["affix_reuse"]["decision"] == "reused"
    assert forced["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    reused = llm.generate(llm.chat_prompt(messages), SamplingParams(gen_length=2, block_length=2,
                                                                    selector="attention"), use_tqdm=False)[0]
    assert forced["choices"][0]["token_ids"] == reused.token_ids
    assert off["usage"]["affix_reuse"]["decision"] == "none" and off["usage"]["affix_reuse"]["spans"] == []
    assert off["choices"][0]["token_ids"] == plain_answer(llm, messages)
    assert bad.status_code == 400 and "affix_reuse" in bad.json()["error"]["message"]


def test_the_server_switch_off_never_reuses(llm):
    messages = chat(story(("sofia", "bathroom")), "Where is John?")
    with served(llm, auto_reuse="off") as client:
        answers = [ask(client, messages) for _ in range(3)]
    assert [a["usage"]["affix_reuse"]["decision"] for a in answers] == ["none", "recomputed", "recomputed"]
    assert all(a["usage"]["affix_reuse"]["reason"] == "automatic reuse is off on this server" for a in answers[1:])


def test_a_streamed_check_answers_as_without_reuse_and_is_recorded(llm):
    messages = chat(story(("emma", "hallway")), "Where is Mary?")
    with served(llm) as client:
        ask(client, messages)
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": messages, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
        assert wait_for(lambda: not client.app.state.checks_running)
        assert client.app.state.gate.counts()["checks"] == 1
    chunks = [json.loads(line[6:]) for line in lines]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "kitchen"
    assert chunks[-1]["usage"]["affix_reuse"]["decision"] == "checking"


def test_streams_a_stop_string_cut_earn_trust_on_their_whole_answers(llm):
    """A stream that a stop string ends decodes on in the background once its answer is sent, so that its check
    compares the whole answer: two such streams (at ratio 1, where reuse recomputes every affix token and matches)
    make the span trusted. Compared on what they sent they were no evidence, and the span stayed unchecked."""
    system = story(("sofia", "office"))
    fields = {"max_tokens": 4, "block_length": 1, "anchor_ratio": 1.0}
    with served(llm, reuse_checks=2, reuse_audit_every=0) as client:
        ask(client, chat(system, "Where is Mary?"), **fields)  # the first sighting
        texts = []
        for question in ("Where is John?", "Where is Mary?"):
            with client.stream("POST", "/v1/chat/completions", json={
                    "messages": chat(system, question), "stream": True, "stop": ["e"], **fields}) as resp:
                lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
            chunks = [json.loads(line[6:]) for line in lines]
            texts.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]))
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert wait_for(lambda: not client.app.state.checks_running)
        after = ask(client, chat(system, "Where is Sofia?"), **fields)
    assert texts == ["gard", "kitch"]  # cut inside the first of four one-column blocks
    assert client.app.state.gate.totals == {"checks": 2, "mismatches": 0}
    assert after["usage"]["affix_reuse"]["decision"] == "reused"


def test_a_check_that_cannot_run_leaves_the_request_answered(llm, monkeypatch):
    """When the request with reuse would be refused (here: made to be), the answer without reuse still comes."""
    messages = chat(story(("daniel", "cellar")), "Where is Mary?")
    engine_check = llm.engine.check_request

    def refuse_reuse(prompt, params):
        if prompt.affixes:
            raise ValueError("no room for it")
        return engine_check(prompt, params)

    with served(llm) as client:
        ask(client, messages)
        monkeypatch.setattr(llm.engine, "check_request", refuse_reuse)
        out = ask(client, messages)
        assert client.app.state.gate.counts()["checks"] == 0
    assert out["usage"]["affix_reuse"]["decision"] == "recomputed"
    assert out["usage"]["affix_reuse"]["reason"] == "not checked: with reuse, no room for it"
    assert out["choices"][0]["token_ids"] == plain_answer(llm, messages)


def test_a_request_refused_after_its_check_was_planned_frees_the_check(llm, monkeypatch):
    """A request refused (400) after the gate planned its check never runs that check: the gate must not count it
    as running, or the span (whose record then never gives way) could wait for it for good."""
    messages = chat(story(("john", "hallway")), "Where is Mary?")
    engine_check = llm.engine.check_request

    def refuse_plain(prompt, params):
        if not prompt.affixes:
            raise ValueError("refused here")
        return engine_check(prompt, params)

    with served(llm, reuse_checks=1) as client:
        ask(client, messages)
        monkeypatch.setattr(llm.engine, "check_request", refuse_plain)
        resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert resp.status_code == 400 and "refused here" in resp.json()["error"]["message"]
        monkeypatch.undo()
        out = ask(client, messages)  # the one check the span allows is free again
    assert out["usage"]["affix_reuse"]["decision"] == "checking"


@pytest.mark.parametrize("kwargs, message", [
    ({"auto_reuse": "sometimes"}, "auto reuse mode must be one of"),
    ({"reuse_checks": 0}, "checks must be an integer >= 1"),
    ({"reuse_audit_every": -2}, "audit_every must be an integer >= 0"),
])
def test_bad_server_settings_are_named(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_app(llm, "acache-tiny", **kwargs)


@pytest.mark.parametrize("fails_at", ["http.response.start", "http.response.body"])
def test_a_stream_whose_client_leaves_at_once_settles_its_check(llm, fails_at):
    """A streamed chat whose check was planned, and whose client is gone before the stream begins (the events
    never run) or at its first event: either way the gate no longer counts the check as running, so the span can
    be checked again (a leak used one of its checks, or an audit, for good)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from acache.server.protocol import ChatCompletionRequest
    from acache.server.serving import Check, CheckedStream, OpenAIServing, ServerContext

    app = create_app(llm, "acache-tiny", reuse_checks=1)
    state = app.state
    ctx = ServerContext(llm=llm, model_name="acache-tiny", engine=state.engine, drain=state.drain, scorer=state.scorer,
                        score_pool=ThreadPoolExecutor(1), registry=state.registry, affixer=state.affixer,
                        gate=state.gate, counters=state.counters, checks_running=state.checks_running)
    serving = OpenAIServing(ctx)
    messages = chat(story(("sandra", "garden")), "Where is Mary?")
    prompt = llm.chat_prompt(messages, affix_messages=[])
    with_affix = llm.chat_prompt(messages)
    params = SamplingParams(gen_length=2, block_length=2)
    plan = state.gate.plan(("span",), params, True, False)
    check = Check(with_affix, params, plan.key)
    body = ChatCompletionRequest(messages=messages, stream=True, max_tokens=2)

    async def send(message: dict) -> None:
        if message["type"] == fails_at:
            raise OSError("the client is gone")

    async def receive() -> dict:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def serve() -> None:
        state.engine.start()
        response = CheckedStream(serving.stream_events(prompt, params, body, "rid", 0, chat=True, check=check),
                                 check, state.gate)
        with pytest.raises(Exception):  # noqa: B017 (Starlette's ClientDisconnect, or the OSError)
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        await asyncio.sleep(0)  # the check's cancellation runs

    try:
        asyncio.run(serve())
    finally:
        state.engine.shutdown()
    assert check.started is (fails_at == "http.response.body")
    assert state.gate.plan(("span",), params, True, False).decision is Decision.CHECK  # not still "running"


def test_one_chat_sent_again_never_earns_trust_for_the_other_questions(llm):
    """The guide's chat sent five times made its system prompt trusted (four matching checks of one request), and
    every other question on it was then answered with reuse: Mary's and Sandra's answers changed. One request
    again is no new evidence: it is recomputed, and Mary's question is checked, not reused."""
    with served(llm) as client:  # the guide's story: John's answer is the same with reuse, Mary's is not
        repeats = [ask(client, chat(STORY, "Where is John?")) for _ in range(5)]
        mary = ask(client, chat(STORY, "Where is Mary?"))
    decisions = [a["usage"]["affix_reuse"]["decision"] for a in repeats]
    # a first sighting reuses nothing ("none"; the story may be held already from another test): one check, then
    # the same request again is recomputed, never checked or reused
    assert decisions.count("checking") == 1 and decisions[-3:] == ["recomputed"] * 3, decisions
    assert "checked already" in repeats[-1]["usage"]["affix_reuse"]["reason"]
    assert mary["usage"]["affix_reuse"]["decision"] == "checking"  # was "reused", answering "mary"
    assert mary["choices"][0]["message"]["content"] == "kitchen"
    assert mary["choices"][0]["token_ids"] == plain_answer(llm, chat(STORY, "Where is Mary?"))


@pytest.fixture(scope="module")
def joining_tokenizer(tmp_path_factory):
    """A byte-level tokenizer that puts a space before every text it encodes, and a plain chat template: two
    messages encoded together are not the two encoded one after the other."""
    from tests.conftest import tiny_checkpoint

    root = tiny_checkpoint(tmp_path_factory.mktemp("joining"), "llada")
    tok = json.loads((root / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (root / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(root, page_size=8, kv_cache_memory=1 << 22)


def test_messages_reused_together_keep_the_ids_they_have_apart(joining_tokenizer):
    """Consecutive earlier messages form one span; its ids were those of the messages' text joined, which such a
    tokenizer encodes otherwise, so every request of that chat got another prompt than with reuse off. Now the
    span is the messages' own encodings one after the other: the prompt, and so the answer, are the same."""
    llm = joining_tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    joined = llm.tokenizer.encode("system: be brief\nuser: hi\n", add_special_tokens=False)
    apart = [t for text in ("system: be brief\n", "user: hi\n") for t in llm.tokenizer.encode(text, False)]
    assert joined != apart  # the case at hand
    with served(llm) as client:
        off = ask(client, messages, affix_reuse="off", max_tokens=8)
        auto = [ask(client, messages, max_tokens=8) for _ in range(2)]
        counted = client.post("/tokenize", json={"messages": messages}).json()["count"]  # it encoded the whole
    assert all(a["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"] == counted for a in auto)
    assert all(a["choices"][0]["token_ids"] == off["choices"][0]["token_ids"] for a in auto)
    assert auto[1]["usage"]["affix_reuse"]["decision"] == "checking"  # the span was a candidate, and checked


def test_offline_chat_encodes_a_prompt_as_the_server_does(joining_tokenizer):
    """LLM.generate(chat=True) encoded the rendered chat as one text, where the server (and LLM.chat_prompt)
    encode it message by message: with such a tokenizer the same question got another prompt offline."""
    llm = joining_tokenizer
    whole = llm.tokenizer.encode(llm.inputs.render_chat([{"role": "user", "content": "hi"}]), False)
    params = SamplingParams(gen_length=8, block_length=8, steps=8)
    out = llm.generate("hi", params, chat=True, use_tqdm=False)[0]
    want = list(llm.chat_prompt([{"role": "user", "content": "hi"}], affix_messages=[]).token_ids)
    assert out.prompt_token_ids == want != whole
    with served(llm) as client:
        served_out = ask(client, [{"role": "user", "content": "hi"}], affix_reuse="off", max_tokens=8)
    assert served_out["usage"]["prompt_tokens"] == len(want)
    assert served_out["choices"][0]["token_ids"] == out.token_ids


def test_max_tokens_fitted_to_the_context_hold_when_a_span_is_a_candidate(llm):
    """A 208-token chat with max_tokens 40 in the shipped model's context of 256 is served in blocks of 20 (whole
    default blocks would pass the context); once its system prompt was a candidate, the request recomputed without
    that fitting and was refused, every time."""
    system = " ".join(["mary moved to the kitchen ."] * 33)
    messages = chat(system, "where is mary ?")
    assert len(llm.chat_prompt(messages).token_ids) + 64 > llm.max_model_len >= len(llm.chat_prompt(messages)
                                                                                      .token_ids) + 40
    with served(llm) as client:
        answers = [ask(client, messages, max_tokens=40) for _ in range(3)]
    assert [a["usage"]["affix_reuse"]["decision"] for a in answers][:2] == ["none", "checking"]
    assert len({tuple(a["choices"][0]["token_ids"]) for a in answers}) == 1


def test_a_check_on_part_of_an_answer_earns_no_trust_for_the_whole(llm):
    """Checks whose answers a stop string cut (here to nothing: every letter stops them) matched on what their
    clients were sent, earned the span trust, and a later request with no stop string was answered with reuse:
    "daniel", where the answer without reuse is "garden". A check now compares the whole region decoded."""
    import string

    system = story(("emma", "garage"))
    stops = list(string.ascii_lowercase)
    with served(llm) as client:
        ask(client, chat(system, "Where is Mary?"))  # the first sighting
        checked = [ask(client, chat(system, q), stop=stops)
                   for q in ("Where is Mary?", "Where is John?", "Where is Emma?", "Where is Sandra?")]
        later = ask(client, chat(system, "Where is Daniel?"))
    assert [c["choices"][0]["message"]["content"] for c in checked] == [""] * 4
    assert later["usage"]["affix_reuse"]["decision"] != "reused"
    assert later["choices"][0]["token_ids"] == plain_answer(llm, chat(system, "Where is Daniel?"))
    # what reuse gives that question, so that trusting the span would have changed its answer
    reused = llm.generate(llm.chat_prompt(chat(system, "Where is Daniel?")),
                          SamplingParams(gen_length=2, block_length=2, selector="attention"), use_tqdm=False)[0]
    assert reused.token_ids != later["choices"][0]["token_ids"]


def test_a_stream_cut_by_a_stop_string_can_only_show_a_mismatch():
    """A streamed answer a stop string ended was not decoded whole: its sent tokens (the first ``max_tokens``, cut
    at the stop string) are compared, and a match there settles nothing, where a mismatch refuses the span."""
    from types import SimpleNamespace

    from acache.server.reuse_gate import ReuseGate
    from acache.server.serving import Check, OpenAIServing

    def decode(ids):
        return "".join("ab\nd"[i] for i in ids)

    assert Check(None, None, (), limit=3, stops=("\n",)).sent([0, 1, 2, 3], decode) == [0, 1]
    assert Check(None, None, (), limit=1).sent([0, 1, 2, 3], decode) == [0]

    class Done:
        def __init__(self, token_ids):
            self.token_ids = token_ids

        def cancelled(self):
            return False

        def exception(self):
            return None

        def result(self):
            return SimpleNamespace(token_ids=self.token_ids)

        def add_done_callback(self, fn):
            fn(self)

    gate = ReuseGate(checks=1)
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.ctx = SimpleNamespace(gate=gate)
    serving.llm = SimpleNamespace(tokenizer=SimpleNamespace(decode=decode))
    for plain_ids, reused_ids, finished, state in (
            ([0, 1, 2], [0, 1, 2, 3], False, "checked 0"),  # the sent [0, 1] match: no evidence
            ([0, 1, 2, 0], [0, 1, 2, 3], True, "refused"),  # decoded whole: the tail differs
            ([0, 1, 2], [0, 3, 2, 3], False, "refused")):  # the sent part differs: a mismatch
        key = (("span", state, finished),)
        plan = gate.plan(key[0], SamplingParams(gen_length=4, block_length=4), True, False, "r")
        check = Check(None, None, plan.key, plan.request, limit=3, stops=("\n",), started=True)
        serving.settle_check(Done(reused_ids), check, SimpleNamespace(token_ids=plain_ids, finished=finished))
        assert gate.state(plan.key) == state, (plain_ids, reused_ids, finished)
        if state == "checked 0":  # no evidence, and the same request is not checked again and again
            again = gate.plan(key[0], SamplingParams(gen_length=4, block_length=4), True, False, "r")
            assert again.decision is Decision.RECOMPUTE and "checked already" in again.reason


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("stop_token_ids", [7])])
def test_where_decoding_stops_is_part_of_what_a_check_vouches_for(field, value):
    """A request decoding past EOS (or stopping at other tokens) decodes blocks a check that stopped at EOS never
    compared."""
    from acache.server.reuse_gate import policy_key

    base = SamplingParams(gen_length=4, block_length=4)
    assert policy_key(("s",), base) != policy_key(("s",), SamplingParams(gen_length=4, block_length=4,
                                                                        **{field: value}))
    assert policy_key(("s",), SamplingParams(gen_length=4, block_length=4, stop_token_ids=[7, 3])) == policy_key(
        ("s",), SamplingParams(gen_length=4, block_length=4, stop_token_ids=[3, 7, 7]))


def test_a_request_refused_with_a_400_is_no_sighting(llm):
    """A chat refused for its sampling fields (n, top_p) or its length counted as a sighting of its system prompt,
    so that the next valid request reused the span at its first real sighting."""
    system = story(("sofia", "garage"))
    messages = chat(system, "Where is Daniel?")
    with served(llm, auto_reuse="on") as client:
        for bad, why in (({"n": 2}, "n=1"), ({"top_p": 0.5}, "top_p"), ({"max_tokens": 256}, "too long")):
            resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **bad})
            assert resp.status_code == 400 and why in resp.json()["error"]["message"], resp.text
        first = ask(client, messages)
        second = ask(client, messages)
    assert first["usage"]["affix_reuse"]["decision"] == "none"
    assert second["usage"]["affix_reuse"]["decision"] == "reused"


def test_another_seed_at_temperature_zero_is_the_same_request(llm):
    """At temperature 0 a seed changes nothing the default selector decodes: one chat sent with seeds 1, 2, 3 is one
    request, checked once (it counted as three)."""
    messages = chat(story(("lucas", "cellar")), "Where is John?")
    with served(llm, reuse_checks=2) as client:
        answers = [ask(client, messages, seed=seed) for seed in (1, 2, 3, 4)]
    decisions = [a["usage"]["affix_reuse"]["decision"] for a in answers]
    assert decisions.count("checking") == 1 and "reused" not in decisions, decisions


@pytest.mark.parametrize("when", ["before its first step", "mid-decode"])
def test_a_handed_off_check_cancelled_by_a_shutdown_is_settled_once(when):
    """A shutdown out of grace cancels the background decoding of a stream a stop string ended; cancelled before
    its first step it ran none of its code, and its check was never settled (the gate counted it running for good).
    Either way it is settled once, on what the client was sent."""
    import asyncio
    from types import SimpleNamespace

    from acache.server.serving import OpenAIServing

    settled, closed = [], []

    async def outputs():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield SimpleNamespace(token_ids=[1, 2, 3], finished=False)
        finally:
            closed.append(True)

    async def main():
        serving = OpenAIServing.__new__(OpenAIServing)
        serving.ctx = SimpleNamespace(checks_running=set())
        serving.settle_check = lambda shadow, check, plain: settled.append(plain)
        gen = outputs()
        await gen.__anext__()  # parked at its yield, as the stream leaves it
        cut = SimpleNamespace(token_ids=[1], finished=False)
        task = serving.hand_off(gen, None, None, cut)
        if when == "mid-decode":
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        return serving.ctx.checks_running, list(closed)

    running, closed_in_time = asyncio.run(main())
    assert len(settled) == 1 and settled[0].token_ids == [1] and not running
    # a task that ran closes the generator, which aborts the engine request; one that never ran leaves that to the
    # shutdown's cancel_all
    assert closed_in_time == ([True] if when == "mid-decode" else [])
