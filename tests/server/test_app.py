"""The app in process: health after an engine fault, and a bounded fuzz of the request bodies (no 500)."""

from __future__ import annotations

import json
import os
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acache import LLM, SamplingParams
from acache.server.app import create_app

FUZZ_EXAMPLES = int(os.environ.get("ACACHE_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def client(llada_dir):
    llm = LLM(llada_dir, page_size=8, kv_cache_memory=1 << 22)
    with TestClient(create_app(llm, "tiny", max_request_bytes=50_000)) as c:
        yield c


def test_health_stays_200_while_the_engine_serves_after_a_failed_step(llada_dir, monkeypatch):
    """A step that fails fails its requests, and the engine serves on: /health says so and stays 200 (it was 503
    for good, so a load balancer drained a working server), naming the last fault."""
    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    real = llm.engine.step
    with TestClient(create_app(llm, "tiny")) as c:
        assert c.get("/health").json() == {"status": "ok"}

        def broken():
            raise MemoryError("device out of memory")

        monkeypatch.setattr(llm.engine, "step", broken)
        resp = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert resp.status_code == 500 and "the engine failed" in resp.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["last_step_error"] == "MemoryError: device out of memory"
        monkeypatch.setattr(llm.engine, "step", real)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200


def test_health_is_503_once_the_engine_thread_has_stopped(llada_dir, monkeypatch):
    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    with TestClient(create_app(llm, "tiny")) as c:
        target = c.app.state.engine

        def fail_aborts():
            raise RuntimeError("the loop failed")

        monkeypatch.setattr(target, "_process_aborts", fail_aborts)
        target.wake.set()
        for _ in range(100):
            if target.dead is not None:
                break
            time.sleep(0.05)
        health = c.get("/health")
        assert health.status_code == 503 and "RuntimeError" in health.json()["error"]


@pytest.mark.parametrize("at", ["step", "add"])
def test_ranks_that_no_longer_agree_make_the_server_unhealthy_and_refuse_later_requests(llada_dir, monkeypatch, at):
    """A RankFault (tensor-parallel ranks that ended a call differently) is not a step to serve past: every later
    call would raise it. /health turns 503 naming it, and later requests are refused with its message."""
    from acache.engine.parallel import RankFault

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    with TestClient(create_app(llm, "tiny")) as c:
        def disagree(*args, **kwargs):
            raise RankFault("the tensor-parallel ranks ended an engine call differently")

        monkeypatch.setattr(llm.engine, "step" if at == "step" else "add_request", disagree)
        first = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert first.status_code == 500 and "ranks ended an engine call differently" in first.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and "RankFault" in health.json()["error"]
        later = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert later.status_code == 500 and "serves no more requests" in later.json()["error"]["message"]


FIELDS = ["prompt", "messages", "max_tokens", "gen_length", "block_length", "steps", "threshold", "factor",
          "temperature", "seed", "remasking", "selector", "anchor_ratio", "affix", "stop", "stream", "n", "model",
          "text", "name", "affix_layout", "bogus", "top_p", "logprobs", "suffix", "echo", "max_completion_tokens",
          "stream_options", "tools", "response_format", "best_of", "far_mask_window", "focus_layers", "focus_ratio"]
scalars = (st.none() | st.booleans() | st.integers(-3, 70) | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["attention", "bicache-matched", "off", "threshold", "", "\ud800", "héllo"]))
def nested(inner):
    return st.one_of(st.lists(inner, max_size=3),
                     st.dictionaries(st.sampled_from(["role", "content", "name", "x"]), inner, max_size=3))


values = st.recursive(scalars, nested, max_leaves=6)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
chats = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text(max_size=20)}),
    max_size=3)}, optional={"max_tokens": st.integers(-1, 9), "stream": st.booleans(), "selector": scalars})


@settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/affixes", "/tokenize"]),
       body=bodies | chats)
def test_fuzzed_bodies_never_answer_500(client, path, body):
    if isinstance(body.get("max_tokens"), int) and body.get("max_tokens") > 64:
        body["max_tokens"] = 64  # keep the accepted ones quick
    data = json.dumps(body)
    resp = client.post(path, content=data, headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (path, data, resp.text)
    if resp.status_code >= 400:
        assert resp.json()["error"]["message"]


def test_a_request_cancelled_while_waiting_to_be_added_is_never_added(llada_dir):
    """The client goes away while its add waits for the engine's lock, and the loop handles the abort
    first: the add is dropped, not run to the end for nobody."""
    from acache import SamplingParams
    from acache.affix.prompt import AffixPrompt
    from acache.server.async_engine import AsyncEngine

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    engine = AsyncEngine(llm.engine)
    engine.request_abort("srv-9")  # the caller's finally, on cancellation
    with engine.lock:
        engine._process_aborts()  # the loop's turn: nothing to abort yet
    engine._add(AffixPrompt((1, 2, 3), 3), SamplingParams(gen_length=8, block_length=8), "srv-9", False, None)
    assert not llm.engine.has_unfinished()
    engine._add(AffixPrompt((1, 2, 3), 3), SamplingParams(gen_length=8, block_length=8), "srv-10", False, None)
    assert llm.engine.request_ids() == ["srv-10"]  # an add nobody cancelled goes in


@pytest.mark.parametrize("family", ["r2lm", "blockdiff_ssm"])
def test_a_state_cache_family_is_served(tmp_path, family):
    """The OpenAI endpoints serve a state-cache family through the engine; a chat's system prompt is computed with
    the request (nothing to reuse), and what the family cannot do is a 400 that names it."""
    from acache import SamplingParams
    from acache.cli import main

    root = tmp_path / family
    assert main(["make-random-checkpoint", "--family", family, "--out", str(root), "--hidden-size", "32",
                 "--layers", "2", "--heads", "2", "--block-size", "4", "--std", "0.3"]) == 0
    llm = LLM(root)
    with TestClient(create_app(llm, "scan")) as c:
        resp = c.post("/v1/completions", json={"prompt": "Where is Mary?", "max_tokens": 8, "block_length": 4,
                                               "threshold": 0.5})
        assert resp.status_code == 200, resp.text
        want = LLM(root).generate("Where is Mary?", SamplingParams(gen_length=8, block_length=4, threshold=0.5),
                                  use_tqdm=False)[0]
        assert resp.json()["choices"][0]["token_ids"] == want.token_ids
        chat = {"messages": [{"role": "system", "content": "Mary went home."}, {"role": "user", "content": "Where?"}],
                "max_tokens": 4}
        resp = c.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 200, resp.text
        # a registered affix is computed with the prompt, as a chat's system prompt is (it was a 400 naming the
        # served default selector, which the client never sent)
        affix = c.post("/v1/affixes", json={"text": "Mary went home."}).json()["id"]
        resp = c.post("/v1/completions", json={"prompt": " Where?", "affix": affix, "max_tokens": 4,
                                               "block_length": 4})
        assert resp.status_code == 200, resp.text
        whole = c.post("/v1/completions", json={"prompt": llm.inputs.encode_text("Mary went home.")
                                                + llm.inputs.encode_text(" Where?"), "max_tokens": 4,
                                                "block_length": 4})
        assert resp.json()["choices"][0]["token_ids"] == whole.json()["choices"][0]["token_ids"]
        assert resp.json()["usage"]["affix_reuse"]["decision"] == "none"
        assert resp.json()["usage"]["affix_reuse"]["reason"] == f"the {family} family computes affixes with the request"
        # with no affix there is nothing to refuse 'always' for (it was refused once the affix check came in)
        resp = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "affix_reuse": "always"})
        assert resp.status_code == 200, resp.text
        for path, body, why in [("/v1/chat/completions", {**chat, "selector": "attention"}, "does not support"),
                                ("/v1/completions", {"prompt": "hi", "affix": affix, "max_tokens": 4,
                                                     "selector": "attention"}, "does not support"),
                                ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 1},
                                 f"not supported for the {family} family"),
                                ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "suffix": " there"},
                                 "tokens after its generation region"),
                                ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "far_mask_window": 1},
                                 "far_mask_window is not supported")]:
            resp = c.post(path, json=body)
            assert resp.status_code == 400 and why in resp.json()["error"]["message"], resp.text
        scraped = c.get("/metrics")  # bytes, not pages: a state-cache family's caches are its own
        assert scraped.status_code == 200, scraped.text
        gauges = dict(line.rsplit(" ", 1) for line in scraped.text.splitlines()
                      if line.startswith("acache_cache_bytes"))
        assert float(gauges["acache_cache_bytes_total"]) == llm.engine.kv.budget_bytes
        assert float(gauges["acache_cache_bytes_in_use"]) == 0 < float(gauges["acache_cache_bytes_peak"])
        assert "acache_kv_pages_in_use" not in scraped.text


def test_generate_beside_a_running_server_is_refused(llada_dir):
    """The server's loop steps its engine on its own thread; an offline generate() on the same LLM would step it
    too, and the two would corrupt each other's requests. It is refused by name while serving, and works after."""
    llm = LLM(llada_dir, kv_cache_memory=1 << 24)
    params = SamplingParams(gen_length=4, block_length=4)
    with TestClient(create_app(llm, "m")) as c:
        with pytest.raises(RuntimeError, match="being served"):
            llm.generate("Where is Mary?", params, use_tqdm=False)
        resp = c.post("/v1/completions", json={"prompt": "Where is Mary?", "max_tokens": 4, "block_length": 4})
        assert resp.status_code == 200, resp.text
        served = resp.json()["choices"][0]["token_ids"]
    assert llm.generate("Where is Mary?", params, use_tqdm=False)[0].token_ids == served


def test_the_prompts_of_one_completion_request_are_decoded_together(llada_dir):
    """Four prompts in one request share the engine's batches: the forwards taken are about those of one request
    (32), give or take the steps between their adds, not four times as many; each answers as alone."""
    llm = LLM(llada_dir, page_size=8, kv_cache_memory=1 << 22)
    prompts = [[5, 6, 7], [8, 9, 10], [13, 14, 12], [15, 16, 17]]
    fields = {"max_tokens": 32, "gen_length": 32, "block_length": 8, "steps": 32}
    with TestClient(create_app(llm, "tiny")) as c:
        alone = [c.post("/v1/completions", json={"prompt": p, **fields}).json()["choices"][0]["token_ids"]
                 for p in prompts]
        llm.engine.reset_metrics()
        resp = c.post("/v1/completions", json={"prompt": prompts, **fields})
        steps = llm.engine.summary()["refreshes"] + llm.engine.metrics.step_times.count
    assert resp.status_code == 200
    assert [choice["token_ids"] for choice in resp.json()["choices"]] == alone
    assert steps < 2 * 32  # one after another: 4 x 32


def test_the_prompts_of_a_request_beside_another_arriving_later_each_answer_as_alone(llada_dir):
    """A request of three prompts and, 0.1 s into it, a request of other parameters (length, blocks, steps): each of
    the four answers decode as they do alone."""
    import threading

    llm = LLM(llada_dir, page_size=8, kv_cache_memory=1 << 22)
    many = {"prompt": [[5, 6, 7], [8, 9], [10, 11, 12, 13]], "max_tokens": 32, "gen_length": 32, "block_length": 8,
            "steps": 32}
    other = {"prompt": [14, 15, 16], "max_tokens": 16, "gen_length": 16, "block_length": 4, "steps": 8}
    with TestClient(create_app(llm, "tiny")) as c:
        alone = [c.post("/v1/completions", json={**many, "prompt": p}).json()["choices"][0]["token_ids"]
                 for p in many["prompt"]]
        alone.append(c.post("/v1/completions", json=other).json()["choices"][0]["token_ids"])
        got: dict[str, list] = {}

        def later() -> None:
            time.sleep(0.1)
            got["other"] = [ch["token_ids"] for ch in c.post("/v1/completions", json=other).json()["choices"]]

        t = threading.Thread(target=later)
        t.start()
        got["many"] = [ch["token_ids"] for ch in c.post("/v1/completions", json=many).json()["choices"]]
        t.join(timeout=60)
    assert got["many"] + got["other"] == alone


def test_one_failing_prompt_of_a_request_stops_the_others(llada_dir, monkeypatch):
    """A request's prompts decode together; the first to fail answers the request (500 with its message) and the
    others are aborted, not left decoding."""
    import asyncio

    from acache.server.serving import OpenAIServing, RequestError

    llm = LLM(llada_dir, page_size=8, kv_cache_memory=1 << 22)
    real = OpenAIServing.final_output

    async def final_output(self, prompt, params, check=None):
        if len(prompt.token_ids) == 2:
            await asyncio.sleep(0.2)  # the other prompt is decoding by now
            raise RequestError("the request failed: this prompt broke")
        return await real(self, prompt, params, check)

    monkeypatch.setattr(OpenAIServing, "final_output", final_output)
    with TestClient(create_app(llm, "tiny")) as c:
        resp = c.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 480, "steps": 480})
        assert resp.status_code == 500 and "this prompt broke" in resp.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        for _ in range(100):
            if not llm.engine.has_unfinished():
                break
            time.sleep(0.05)
    assert not llm.engine.has_unfinished() and llm.engine.summary()["requests_aborted"] == 1


def test_prompts_that_fail_together_leave_no_unread_failure(llada_dir, monkeypatch, caplog):
    """Every prompt of a request failing at once (a shutdown, an engine fault): one answers the request, and the
    others' failures are read too (asyncio logged "Task exception was never retrieved" for each before)."""
    import gc
    import logging

    from acache.server.serving import OpenAIServing, RequestError

    async def final_output(self, prompt, params, check=None):
        raise RequestError(f"the request failed: prompt of {len(prompt.token_ids)} tokens")

    monkeypatch.setattr(OpenAIServing, "final_output", final_output)
    llm = LLM(llada_dir, page_size=8, kv_cache_memory=1 << 22)
    with caplog.at_level(logging.ERROR, logger="asyncio"), TestClient(create_app(llm, "tiny")) as c:
        resp = c.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9], [10]], "max_tokens": 8})
        gc.collect()
    assert resp.status_code == 500 and "prompt of 3 tokens" in resp.json()["error"]["message"]
    assert "never retrieved" not in caplog.text
