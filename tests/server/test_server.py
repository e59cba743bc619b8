"""A real server process driven by the official openai client: answers, streaming, load, bad input."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from acache import LLM, SamplingParams  # noqa: E402
from tests.server.helpers import start_server, wait_until  # noqa: E402

KEY = "test-key"
SYSTEM = "You answer in one word. Mary moved to the kitchen. John went to the garden."


@pytest.fixture(scope="module")
def server(llada_dir):
    proc, port = start_server(["--model", str(llada_dir), "--api-key", KEY, "--max-num-seqs", "16",
                               "--page-size", "8", "--max-request-bytes", "200000"])
    yield port
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(llada_dir):
    return LLM(llada_dir, page_size=8)


def raw(port: int, method: str, path: str, body: bytes | None = None, key: str | None = KEY):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def metric(port: int, name: str) -> float:
    _, text = raw(port, "GET", "/metrics")
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"acache_{name} ")))


def extra(choice, name):
    return getattr(choice, name, None) if getattr(choice, name, None) is not None else choice.model_extra[name]


def test_completion_matches_llm_generate(client, llm):
    out = client.completions.create(model="llada0", prompt="Where is Mary?", max_tokens=16,
                                    extra_body={"block_length": 8, "threshold": 0.5})
    want = llm.generate("Where is Mary?", SamplingParams(gen_length=16, block_length=8, threshold=0.5),
                        use_tqdm=False)[0]
    choice = out.choices[0]
    assert extra(choice, "token_ids") == want.token_ids and choice.text == want.text
    assert out.usage.completion_tokens == len(want.token_ids) and out.model == "llada0"


def test_chat_matches_llm_generate_and_reuses_the_system_prompt(client, llm, server):
    messages = [{"role": "system", "content": SYSTEM + " (chat test)"}, {"role": "user", "content": "Where is John?"}]
    params = SamplingParams(gen_length=16, block_length=8, threshold=0.5)
    body = {"block_length": 8, "threshold": 0.5}
    hits = metric(server, "affix_hits_total")
    first = client.chat.completions.create(model="llada0", messages=messages, max_tokens=16, extra_body=body)
    plain = llm.generate([list(llm.chat_prompt(messages, affix_messages=[]).token_ids)], params, use_tqdm=False)[0]
    assert extra(first.choices[0], "token_ids") == plain.token_ids
    # seen again: answered without reuse while reuse is checked beside it
    second = client.chat.completions.create(model="llada0", messages=messages, max_tokens=16, extra_body=body)
    assert extra(second.choices[0], "token_ids") == plain.token_ids
    assert second.usage.model_extra["affix_reuse"]["decision"] == "checking"
    forced = client.chat.completions.create(model="llada0", messages=messages, max_tokens=16,
                                            extra_body={**body, "affix_reuse": "always"})
    reused = llm.generate(llm.chat_prompt(messages), SamplingParams(gen_length=16, block_length=8, threshold=0.5,
                                                                     selector="attention"), use_tqdm=False)[0]
    assert extra(forced.choices[0], "token_ids") == reused.token_ids
    assert forced.choices[0].message.content == reused.text
    assert forced.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(server, "affix_queries_total") >= 1 and metric(server, "affix_hits_total") >= hits + 1


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "Tell me where Sandra is."}]
    body = {"block_length": 8, "threshold": 0.5}
    whole = client.chat.completions.create(model="llada0", messages=messages, max_tokens=32, extra_body=body)
    chunks = list(client.chat.completions.create(model="llada0", messages=messages, max_tokens=32, stream=True,
                                                 extra_body=body))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert sum((extra(c.choices[0], "token_ids") for c in chunks), []) == extra(whole.choices[0], "token_ids")
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert sum(1 for c in chunks if extra(c.choices[0], "token_ids")) >= 2  # four blocks, sent as they finish


def test_a_stream_cut_by_a_stop_string_sends_the_tokens_of_a_whole_answer(client):
    """Streams of other shapes, one cut by a stop string, one with stop strings that never match, run side by
    side: each sends the text and the token ids of the same request answered whole."""
    asks = [("Where is Mary?", {"block_length": 4, "threshold": 0.5, "ignore_eos": True}, 16),
            ("Tell me where John went.", {"block_length": 8, "threshold": 0.7, "ignore_eos": True}, 24)]
    wholes = [client.completions.create(model="llada0", prompt=p, max_tokens=n, extra_body=b) for p, b, n in asks]
    texts = [w.choices[0].text for w in wholes]
    assert all(len(t) >= 4 for t in texts)
    stops = [[texts[0][len(texts[0]) // 2:len(texts[0]) // 2 + 2]], ["\u2603never", "\u2603"]]

    def ask(i):
        time.sleep(0.05 * i)  # arriving at different times
        (prompt, body, n), stop = asks[i], stops[i]
        whole = client.completions.create(model="llada0", prompt=prompt, max_tokens=n, stop=stop, extra_body=body)
        chunks = list(client.completions.create(model="llada0", prompt=prompt, max_tokens=n, stop=stop, stream=True,
                                                extra_body=body))
        return whole.choices[0], chunks

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, range(2)))
    for whole, chunks in answers:
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert sum((extra(c.choices[0], "token_ids") for c in chunks), []) == extra(whole, "token_ids")
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert answers[0][0].finish_reason == "stop" and len(extra(answers[0][0], "token_ids")) < 16


def test_load_64_requests_concurrency_16(client, llm, server):
    system = SYSTEM + " (load test)"
    body = {"block_length": 8, "threshold": 0.5, "affix_reuse": "always"}  # reuse from the second sighting
    warm = [{"role": "system", "content": system}, {"role": "user", "content": "warm up"}]
    client.chat.completions.create(model="llada0", messages=warm, max_tokens=8, extra_body=body)  # seen once
    hits_before, queries_before = metric(server, "affix_hits_total"), metric(server, "affix_queries_total")
    questions = [f"Question {i}: where is {['Mary', 'John', 'Sandra', 'Daniel'][i % 4]}?" for i in range(64)]
    shapes = [(16, 8, 0.2), (8, 4, 0.5), (24, 8, 0.1)]  # max_tokens, block_length, anchor_ratio, in turn

    def ask(i):
        tokens, block, ratio = shapes[i % 3]
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": questions[i]}]
        out = client.chat.completions.create(model="llada0", messages=msgs, max_tokens=tokens,
                                             extra_body={**body, "block_length": block, "anchor_ratio": ratio})
        return extra(out.choices[0], "token_ids")

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(64)))
    prompts = [llm.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    want = llm.generate(prompts, [SamplingParams(gen_length=tokens, block_length=block, threshold=0.5,
                                                 selector="attention", anchor_ratio=ratio)
                                  for tokens, block, ratio in (shapes[i % 3] for i in range(64))], use_tqdm=False)
    assert got == [w.token_ids for w in want]
    # the warm-up saw the system prompt once; the first of the 64 computes its shared copy, 63 reuse it
    assert metric(server, "affix_queries_total") - queries_before == 64
    assert metric(server, "affix_hits_total") - hits_before == 63
    assert metric(server, "requests_running") == 0 and metric(server, "requests_waiting") == 0


def test_registered_affix(client, server):
    status, body = raw(server, "POST", "/v1/affixes", json.dumps({"text": "A shared document. " * 5}).encode())
    assert status == 200
    affix_id = json.loads(body)["id"]
    hits = metric(server, "affix_hits_total")
    for _ in range(2):
        client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8, extra_body={"affix": affix_id})
    assert metric(server, "affix_hits_total") == hits + 1  # computed once, reused the second time
    tokens = json.loads(body)["tokens"]
    # a completion on a registered affix says what it reused, as a chat does; two prompts sum their counts
    one = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8,
                                    extra_body={"affix": affix_id, "anchor_ratio": 0.2})
    two = client.completions.create(model="llada0", prompt=["Summarise.", "Name the document, in one longer word."],
                                    max_tokens=8, extra_body={"affix": affix_id, "anchor_ratio": 0.2})
    report = one.usage.model_extra["affix_reuse"]
    assert report["decision"] == "reused" and report["reason"] == "a registered affix"
    assert report["reused_tokens"] == tokens and report["anchor_tokens"] == round(0.2 * tokens) > 0
    assert report["spans"] == [{"tokens": tokens, "kind": "registered"}] and report["anchor_ratio"] == 0.2
    assert 0 < one.usage.prompt_tokens_details.cached_tokens <= tokens - report["anchor_tokens"]
    both = two.usage.model_extra["affix_reuse"]
    assert both["reused_tokens"] == 2 * tokens and both["anchor_tokens"] == 2 * report["anchor_tokens"]
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens_details.cached_tokens
    stream = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"affix": affix_id})
    last = [chunk for chunk in stream][-1]
    assert last.usage.model_extra["affix_reuse"]["reused_tokens"] == tokens
    off = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8,
                                    extra_body={"affix": affix_id, "selector": "off"}).usage.model_extra["affix_reuse"]
    assert (off["decision"], off["reused_tokens"], off["selector"], off["anchor_ratio"]) == ("none", 0, None, None)
    assert "selector or affix_reuse 'off'" in off["reason"]
    # affix_reuse 'off' turns reuse off on a completion as on a chat (it was accepted and ignored: reused)
    plain = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8,
                                      extra_body={"affix": affix_id, "selector": "off"})
    for mode, decision in (("off", "none"), ("always", "reused"), ("auto", "reused")):
        got = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8,
                                        extra_body={"affix": affix_id, "affix_reuse": mode})
        assert got.usage.model_extra["affix_reuse"]["decision"] == decision, mode
        if mode == "off":
            assert got.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    # a stream cut by a stop string in its first block reports the anchors of its partial output
    fields = {"affix": affix_id, "anchor_ratio": 0.2, "block_length": 2, "ignore_eos": True}
    whole = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8, extra_body=fields)
    first = whole.choices[0].text[:1]
    assert first and whole.choices[0].finish_reason == "length"
    cut = list(client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8, stream=True,
                                         stop=[first], stream_options={"include_usage": True}, extra_body=fields))
    assert cut[-2].choices[0].finish_reason == "stop" and cut[-1].usage.completion_tokens < 8
    assert cut[-1].usage.model_extra["affix_reuse"]["anchor_tokens"] == report["anchor_tokens"]
    plain = client.completions.create(model="llada0", prompt="Summarise.", max_tokens=8)
    assert "affix_reuse" not in (plain.usage.model_extra or {}) and plain.usage.prompt_tokens_details is None


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "x",', "malformed JSON body"),
    (json.dumps({"prompt": "x", "top_k": 5}).encode(), "unknown field 'top_k'"),
    (json.dumps({"prompt": "x", "top_p": 0.5}).encode(), "top_p=0.5 cannot be honoured by this diffusion model"),
    (json.dumps({"prompt": "x" * 600}).encode(), "too long"),
    (json.dumps({"prompt": "x", "threshold": 2}).encode(), "threshold must be in (0, 1]"),
    (json.dumps({"prompt": "x", "max_tokens": 10, "block_length": 4, "gen_length": 10}).encode(),
     "must be a multiple of block_length"),
    (json.dumps({"prompt": "x", "affix": "affix-nope"}).encode(), "unknown affix id 'affix-nope'"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature must be >= 0"),
])
def test_bad_input_is_400_with_an_openai_error(server, body, message):
    status, text = raw(server, "POST", "/v1/completions", body)
    assert status == 400
    err = json.loads(text)["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"


def test_auth_and_size_limit(server):
    status, text = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "x"}).encode(), key=None)
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
    status, _ = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "x"}).encode(), key="wrong")
    assert status == 401
    status, text = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "x" * 300000}).encode())
    assert status == 413 and "exceeds the limit" in json.loads(text)["error"]["message"]
    assert raw(server, "GET", "/health", key=None)[0] == 200


def test_disconnect_mid_stream_frees_pages(server):
    baseline = metric(server, "kv_pages_in_use")
    aborted = metric(server, "requests_aborted_total")
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    body = json.dumps({"prompt": "Write a long story.", "stream": True, "gen_length": 256, "block_length": 8,
                       "threshold": 1.0})
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    assert metric(server, "kv_pages_in_use") > baseline
    conn.sock.close()
    conn.close()
    assert wait_until(lambda: metric(server, "requests_aborted_total") == aborted + 1, 30)
    assert metric(server, "requests_running") == 0
    assert metric(server, "kv_pages_in_use") == baseline


def test_models_tokenize_metrics(client, server, llm):
    assert [m.id for m in client.models.list().data] == ["llada0"]
    status, text = raw(server, "POST", "/tokenize", json.dumps({"prompt": "Where is Mary?"}).encode())
    assert status == 200 and json.loads(text)["tokens"] == llm.tokenizer.encode("Where is Mary?")
    _, text = raw(server, "GET", "/metrics")
    for name in ("requests_running", "requests_waiting", "kv_pages_in_use", "cache_bytes_in_use", "affix_hits_total",
                 "affix_queries_total", "anchors_recomputed_total", "recompute_latency_seconds_count",
                 "auto_reuse_checks_total", "auto_reuse_mismatches_total", "auto_reuse_trusted_spans"):
        assert f"acache_{name}" in text
    finished = metric(server, "requests_finished_total")
    # a diffusion model's time to first token is its time to the first completed block; every finished request
    # has one, and one end-to-end latency
    for name in ("time_to_first_block_seconds_count", "e2e_request_latency_seconds_count"):
        assert metric(server, name) >= finished > 0, name
    assert metric(server, "inter_block_latency_seconds_count") > 0  # the earlier tests decode 2-block requests
    assert metric(server, "e2e_request_latency_seconds_sum") >= metric(server, "time_to_first_block_seconds_sum")


def test_max_tokens_cuts_whole_blocks_and_stop_strings(client, llm):
    fields = {"block_length": 8, "threshold": 0.5, "ignore_eos": True}  # ten tokens whatever the model ends with
    out = client.completions.create(model="llada0", prompt="Count:", max_tokens=10, extra_body=fields)
    ids = extra(out.choices[0], "token_ids")
    full = llm.generate("Count:", SamplingParams(gen_length=16, block_length=8, threshold=0.5, ignore_eos=True),
                        use_tqdm=False)[0]
    assert ids == full.token_ids[:10] and out.usage.completion_tokens == 10
    assert out.choices[0].finish_reason == "length"
    # a stop string at the first character that is text of its own (not a byte-level fragment) and not earlier
    text = llm.tokenizer.decode(full.token_ids[:10])
    at = next(i for i, ch in enumerate(text) if i > 0 and ch.isprintable() and ch != "\ufffd" and text.index(ch) == i)
    cut = client.completions.create(model="llada0", prompt="Count:", max_tokens=10, stop=[text[at]],
                                    extra_body=fields)
    assert cut.choices[0].text == text[:at] != "" and cut.choices[0].finish_reason == "stop"


def send(port: int, path: str, body: dict) -> tuple[int, str, list[int] | None, str | None]:
    """Status, text, token ids (non-streaming) and finish reason of one request; a stream is read to its end."""
    status, text = raw(port, "POST", path, json.dumps(body).encode())
    if status != 200:
        return status, text, None, None
    if not body.get("stream"):
        choice = json.loads(text)["choices"][0]
        content = choice["text"] if "text" in choice else choice["message"]["content"]
        return status, content, choice["token_ids"], choice["finish_reason"]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    parts, finish = [], None
    for e in events[:-1]:
        choice = json.loads(e)["choices"][0]
        parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        finish = choice["finish_reason"] or finish
    return status, "".join(parts), None, finish


def test_burst_of_mixed_requests_each_answers_as_alone(server):
    """Concurrent requests mixing lengths, blocks, selectors, ratios, seeded sampling and streaming: every
    one is 200 and equals the same request sent alone."""
    doc = {"text": "A shared document on gardens. " * 4}
    status, text = raw(server, "POST", "/v1/affixes", json.dumps(doc).encode())
    assert status == 200
    affix_id = json.loads(text)["id"]
    selectors = ["attention", "none", "random", "kv-deviation", "all", "query-attention", "first-k", "off"]
    requests = []
    for i in range(24):
        body = {"max_tokens": [2, 8, 64][i % 3], "threshold": 0.5, "stream": i % 4 == 1}
        if i % 5 == 2:
            body["block_length"] = 4
        elif i % 5 == 3:
            body["block_length"] = 8
        if i % 3 == 1:
            body.update(temperature=0.8, seed=100 + i)
        if i % 2 == 0:
            body.update(selector=selectors[i % len(selectors)], anchor_ratio=[0.1, 0.5, 0.9][i % 3])
        if i % 4 == 0:
            requests.append(("/v1/completions", {**body, "prompt": f"Where is the item {i}?", "affix": affix_id}))
        elif i % 4 in (1, 2):
            msgs = [{"role": "system", "content": SYSTEM + " (burst)"}, {"role": "user", "content": f"Who is {i}?"}]
            requests.append(("/v1/chat/completions", {**body, "messages": msgs}))
        else:
            requests.append(("/v1/completions", {**body, "prompt": f"Plain request {i}"}))
    warm = [{"role": "system", "content": SYSTEM + " (burst)"}, {"role": "user", "content": "warm up"}]
    assert send(server, "/v1/chat/completions", {"messages": warm, "max_tokens": 2})[0] == 200  # now an affix
    with ThreadPoolExecutor(24) as pool:
        burst = list(pool.map(lambda r: send(server, *r), requests))
    alone = [send(server, *r) for r in requests]
    for (_, body), got, want in zip(requests, burst, alone, strict=True):
        assert got[0] == 200, (body, got[1])
        assert got == want, body
    assert len({g[1] for g in burst}) > 3  # the answers differ, so the equality above has teeth
    assert metric(server, "requests_running") == 0


def test_non_streaming_client_that_disconnects_is_aborted(server):
    aborted = metric(server, "requests_aborted_total")
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    body = json.dumps({"prompt": "Write a long story.", "gen_length": 480, "block_length": 8, "threshold": 1.0})
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert wait_until(lambda: metric(server, "requests_running") == 1, 10, poll=0.02)  # 480 steps under way
    conn.sock.close()
    conn.close()
    assert wait_until(lambda: metric(server, "requests_aborted_total") == aborted + 1, 30)
    assert wait_until(lambda: metric(server, "requests_running") == 0, 10)


def test_a_scoring_client_that_disconnects_stops_its_scoring(server):
    """Scoring runs one job at a time: had the abandoned job (about 200k forward rows) gone on, the short
    job after it would wait a minute or more; stopped at its next batch, it lets the short one through."""
    def abandoned_count() -> float:  # a server counter appears on its first increment
        _, text = raw(server, "GET", "/metrics")
        return next((float(line.split()[1]) for line in text.splitlines()
                     if line.startswith("acache_requests_abandoned_total ")), 0.0)

    abandoned = abandoned_count()
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
    long_body = json.dumps({"prompt": list(range(5, 255)), "max_tokens": 0, "echo": True, "logprobs": 0,
                            "mc_samples": 1024})
    conn.request("POST", "/v1/completions", body=long_body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    time.sleep(1.5)  # the long job is scoring
    conn.sock.close()
    conn.close()
    assert wait_until(lambda: abandoned_count() == abandoned + 1, 30)
    started = time.monotonic()
    status, text = raw(server, "POST", "/v1/completions", json.dumps(
        {"prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 0, "mc_samples": 1}).encode())
    assert status == 200 and len(json.loads(text)["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",  # no method, path and version
    b"GET /health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",  # a header without a colon
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",  # a length that is not one
])
def test_unparseable_http_gets_the_api_error_shape(server, request_bytes):
    import socket

    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(request_bytes)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["message"].startswith("malformed HTTP request: ")
