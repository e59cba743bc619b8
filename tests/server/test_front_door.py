"""Every bad input a clear 4xx, naming the problem, against a real server on the shipped model; after them
all the server is healthy and still answers as the offline API does."""

from __future__ import annotations

import http.client
import json

import pytest

from acache import LLM, SamplingParams
from acache.paths import default_model
from tests.server.helpers import start_server, wait_until

KEY = "front-door-key"
STORY = "mary moved to the kitchen . john went to the garden . mary journeyed to the office ."
CHAT = [{"role": "system", "content": STORY}, {"role": "user", "content": "where is john?"}]


@pytest.fixture(scope="module")
def door():
    """The shipped model behind a pool of 8 pages (128 tokens), a 20 kB body limit and an API key from the
    environment."""
    proc, port = start_server(["--page-size", "16", "--kv-cache-memory", str(8 * 65536),
                               "--max-request-bytes", "20000"], env={"ACACHE_API_KEY": KEY})
    yield port
    proc.terminate()
    proc.wait(timeout=20)


def call(port, method, path, body=None, auth=f"Bearer {KEY}", raw=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if auth:
        hdrs["Authorization"] = auth
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def registered(port, **body):
    status, text = call(port, "POST", "/v1/affixes", body)
    assert status == 200, text
    return json.loads(text)["id"]


C, CH, AF = "/v1/completions", "/v1/chat/completions", "/v1/affixes"
Q = "where is mary ?"
# (name, method, path, body or raw bytes, expected status, a fragment the message must hold)
CASES = [
    ("free text with punctuation", "POST", C, {"prompt": "Where is Mary?", "max_tokens": 2}, 200, None),
    ("word outside the vocabulary", "POST", C, {"prompt": "where is zorro?"}, 400, "'zorro'"),
    ("non-ascii word", "POST", C, {"prompt": "héllo"}, 400, "'héllo'"),
    ("lone surrogate", "POST", C, b'{"prompt": "\\ud800"}', 400, "lone surrogate"),
    ("infinite temperature", "POST", C, b'{"prompt": "where", "temperature": 1e999}', 400,
     "temperature must be a finite"),
    ("NaN threshold", "POST", C, b'{"prompt": "where", "threshold": NaN}', 400, "threshold must be a finite"),
    ("gen_length 0", "POST", C, {"prompt": Q, "gen_length": 0}, 400, "gen_length"),
    ("block_length 0", "POST", C, {"prompt": Q, "block_length": 0}, 400, "block_length"),
    ("max_tokens 0", "POST", C, {"prompt": Q, "max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens beside gen_length", "POST", C, {"prompt": Q, "gen_length": 8, "max_tokens": -3}, 400,
     "max_tokens"),
    ("negative max_completion_tokens", "POST", CH, {"messages": CHAT, "max_completion_tokens": -5}, 400,
     "max_completion_tokens"),
    ("gen_length shorter than a block", "POST", C, {"prompt": Q, "gen_length": 2}, 200, None),
    ("max_tokens as a string", "POST", C, {"prompt": Q, "max_tokens": "2"}, 400, "max_tokens"),
    ("max_tokens as a bool", "POST", C, {"prompt": Q, "max_tokens": True}, 400, "max_tokens"),
    ("temperature as a string", "POST", C, {"prompt": Q, "temperature": "0.5"}, 400, "temperature"),
    ("negative temperature", "POST", C, {"prompt": Q, "temperature": -1}, 400, "temperature must be >= 0"),
    ("seed out of range", "POST", C, {"prompt": Q, "seed": -3}, 400, "seed"),
    ("empty prompt", "POST", C, {"prompt": ""}, 400, "prompt must not be empty"),
    ("empty prompt list", "POST", C, {"prompt": []}, 400, "prompt must not be empty"),
    ("empty prompt in a list", "POST", C, {"prompt": ["where", ""]}, 400, "prompt must not be empty"),
    ("token id outside the vocabulary", "POST", C, {"prompt": [1, 5000]}, 400, "token id 5000"),
    ("prompt too long", "POST", C, {"prompt": " ".join(["mary"] * 300)}, 400, "too long"),
    ("larger than the pool", "POST", C, {"prompt": Q, "max_tokens": 200}, 400, "more than the whole pool"),
    ("larger than the pool, streaming", "POST", C, {"prompt": Q, "max_tokens": 200, "stream": True}, 400,
     "more than the whole pool"),
    ("unknown selector", "POST", C, {"prompt": Q, "selector": "magic"}, 400, "selector must be one of"),
    ("selector without an affix", "POST", C, {"prompt": Q, "selector": "attention"}, 400,
     "selector applies to a reused affix"),
    ("profiled BiCache without a profile", "POST", C, {"prompt": Q, "selector": "bicache-profiled", "affix": "@story"},
     400, "needs a BiCache profile"),
    ("matched BiCache on an affix", "POST", C, {"prompt": Q, "selector": "bicache-matched", "affix": "@story",
                                                 "max_tokens": 2}, 200, None),
    ("anchor_ratio above 1", "POST", C, {"prompt": Q, "anchor_ratio": 1.5, "affix": "@story"}, 400, "anchor_ratio"),
    ("threshold 0", "POST", C, {"prompt": Q, "threshold": 0}, 400, "threshold must be in (0, 1]"),
    ("steps not a multiple of blocks", "POST", C, {"prompt": Q, "gen_length": 8, "block_length": 4, "steps": 3}, 400,
     "steps"),
    ("unknown remasking", "POST", C, {"prompt": Q, "remasking": "greedy"}, 400, "remasking"),
    ("n of 2", "POST", C, {"prompt": Q, "n": 2}, 400, "only n=1"),
    ("stop_token_ids as a string", "POST", C, {"prompt": Q, "stop_token_ids": "5"}, 400, "stop_token_ids"),
    ("a negative stop token id", "POST", C, {"prompt": Q, "stop_token_ids": [5, -1]}, 400,
     "stop_token_ids must be non-negative"),
    ("a stop token id as a float", "POST", CH, {"messages": CHAT, "stop_token_ids": [2.5]}, 400, "stop_token_ids"),
    ("ignore_eos as a string", "POST", C, {"prompt": Q, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("ignore_eos as a number", "POST", CH, {"messages": CHAT, "ignore_eos": 1}, 400, "ignore_eos"),
    ("unknown field", "POST", C, {"prompt": Q, "top_k": 3}, 400, "unknown field 'top_k'"),
    ("malformed JSON", "POST", C, b'{"prompt": "x",', 400, "malformed JSON"),
    ("another model", "POST", C, {"prompt": Q, "model": "gpt-4"}, 404, "not served here"),
    ("unknown affix id", "POST", C, {"prompt": Q, "affix": "affix-nope"}, 400, "unknown affix id 'affix-nope'"),
    ("chat on the shipped model", "POST", CH, {"messages": CHAT, "max_tokens": 2}, 200, None),
    ("chat with no messages", "POST", CH, {"messages": []}, 400, "messages"),
    ("chat with an unknown role", "POST", CH, {"messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ("chat with an unknown word", "POST", CH, {"messages": [{"role": "user", "content": "qwerty"}]}, 400,
     "'qwerty'"),
    ("chat with a text affix", "POST", CH, {"messages": CHAT, "affix": "@story"}, 400, "registered as text"),
    ("affix with empty messages", "POST", AF, {"messages": []}, 400, "messages must not be empty"),
    ("affix with neither field", "POST", AF, {}, 400, "exactly one of text or messages"),
    ("affix with empty text", "POST", AF, {"text": ""}, 400, "text must not be empty"),
    ("affix with an unknown word", "POST", AF, {"text": "héllo"}, 400, "'héllo'"),
    ("affix with a lone surrogate", "POST", AF, b'{"text": "\\ud800"}', 400, "lone surrogate"),
    ("saving affixes without a directory", "POST", "/v1/affixes/save", {}, 400, "no --affix-cache-dir"),
    ("tokenize an unknown word", "POST", "/tokenize", {"prompt": "héllo"}, 400, "'héllo'"),
    ("tokenize nothing", "POST", "/tokenize", {}, 400, "exactly one of prompt or messages"),
    ("unknown path", "GET", "/v1/nothing", None, 404, "Not Found"),
    ("wrong method", "GET", C, None, 405, "Method Not Allowed"),
    ("body over the limit", "POST", C, {"prompt": "mary " * 5000}, 413, "exceeds the limit of 20000"),
]


def test_every_bad_input_is_a_clear_4xx_and_the_server_stays_well(door):
    story = registered(door, text=STORY)
    seen = []
    for name, method, path, body, status, fragment in CASES:
        if isinstance(body, dict) and body.get("affix") == "@story":
            body = {**body, "affix": story}
        got, text = call(door, method, path, body if isinstance(body, dict) or body is None else None,
                         raw=body if isinstance(body, bytes) else None)
        seen.append((name, got))
        assert got == status, (name, text)
        if fragment is not None:
            assert fragment in json.loads(text)["error"]["message"], (name, text)
    assert len(CASES) >= 40
    assert call(door, "GET", "/health", auth=None)[0] == 200
    llm = LLM(default_model())
    prompt = f"story : {STORY} question : {Q} answer :"
    want = llm.generate(prompt, SamplingParams(gen_length=2, block_length=2), use_tqdm=False)[0]
    status, text = call(door, "POST", C, {"prompt": prompt, "max_tokens": 2})
    assert status == 200 and json.loads(text)["choices"][0]["token_ids"] == want.token_ids
    assert want.text == "office"


def test_auth_is_constant_time_any_case_and_from_the_environment(door):
    body = {"prompt": Q, "max_tokens": 2}
    assert call(door, "POST", C, body, auth=None)[0] == 401
    assert call(door, "POST", C, body, auth="Bearer wrong")[0] == 401
    assert call(door, "POST", C, body, auth=KEY)[0] == 401
    assert call(door, "POST", C, body, auth=f"bearer {KEY}")[0] == 200
    assert call(door, "POST", C, body, auth=f"BEARER {KEY}")[0] == 200


def test_a_chunked_body_is_counted_as_it_arrives(door):
    conn = http.client.HTTPConnection("127.0.0.1", door, timeout=30)
    conn.putrequest("POST", AF)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b'{"text": "' + b"mary " * 2000
    try:
        for _ in range(10):
            conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        conn.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server may answer and close before the whole body is sent
    resp = conn.getresponse()
    assert resp.status == 413 and "exceeds the limit" in json.loads(resp.read())["error"]["message"]


def test_registered_affixes_cannot_be_overwritten_and_are_bounded(door):
    text_id = registered(door, text=STORY)
    messages_id = registered(door, messages=[{"role": "system", "content": STORY}])
    assert text_id != messages_id and registered(door, text=STORY) == text_id
    status, text = call(door, "POST", CH, {"messages": [{"role": "user", "content": "where is mary?"}],
                                           "affix": messages_id, "max_tokens": 2})
    assert status == 200, text
    # bounded: past its bytes the registry lets go of the least recently used id (the door's holds 64 MiB; a small
    # one shows the rule), and one too large for it alone is refused
    from acache.server.affix_reuse import AffixRegistry, _size

    small = AffixRegistry(max_bytes=2 * _size([1, 2], None, None))
    first, second = small.register([1, 2], None, None), small.register([3, 4], None, None)
    small.get(first)  # used: the second is now the least recent
    third = small.register([5, 6], None, None)
    assert len(small) == 2 and small.get(first) and small.get(third)
    with pytest.raises(ValueError, match="unknown affix id"):
        small.get(second)
    with pytest.raises(ValueError, match="more than the registry's"):
        small.register(list(range(50)), None, None)


SHEET = ("mary has 5 pencils . oliver has 3 pencils . lucas has 5 pencils . john has 9 pencils . emma has 3 "
         "pencils . sandra has 5 pencils .")
SUM = f"question : how many pencils do john and lucas have ? story : {SHEET} answer :"


def stream_text(port, body):
    status, text = call(port, "POST", C, {**body, "stream": True})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", text
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    return "".join(c["text"] for c in choices), choices[-1]["finish_reason"], len(choices)


@pytest.mark.parametrize("stop", ["+ 9", "9 =", "= 1", "14"])
def test_a_stop_string_finished_in_a_later_block_is_never_sent_then_taken_back(door, stop):
    """'5 + 9 = 14' arrives two tokens a block; each stop string here spans two blocks or ends the text."""
    body = {"prompt": SUM, "max_tokens": 6, "block_length": 2}
    status, text = call(door, "POST", C, body)
    full = json.loads(text)["choices"][0]
    assert status == 200 and full["text"] == "5 + 9 = 14"
    want = full["text"][:full["text"].index(stop)]
    status, text = call(door, "POST", C, {**body, "stop": stop})
    choice = json.loads(text)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want, "stop")
    from acache.models.tokenizer import Tokenizer

    decode = Tokenizer.from_dir(default_model()).decode
    assert choice["token_ids"] == full["token_ids"][:len(choice["token_ids"])]
    assert decode(choice["token_ids"]) == want.strip() or decode(choice["token_ids"]) + " " == want
    streamed, finish, events = stream_text(door, {**body, "stop": [stop]})
    assert (streamed, finish) == (want, "stop")
    plain, finish, events = stream_text(door, body)
    assert plain == full["text"] and events >= 3  # without a stop, one event a block


def hits(port):
    _, text = call(port, "GET", "/metrics", auth=None)
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("acache_affix_hits_total ")))


def test_a_restart_with_an_affix_cache_dir_serves_warm(tmp_path):
    cache = tmp_path / "affixes"
    body = {"messages": CHAT, "max_tokens": 2}
    first, port = start_server(["--affix-cache-dir", str(cache)])
    try:
        call(port, "POST", CH, body)  # the system prompt seen once
        status, text = call(port, "POST", CH, body)  # seen again: now a shared affix
        assert status == 200
        before = json.loads(text)["choices"][0]
    finally:
        first.terminate()
        first.wait(timeout=30)  # uvicorn shuts down gracefully, then re-raises SIGTERM
    # the check the second request started computed the affix; the shutdown waited for it, then saved it
    assert len(json.loads((cache / "manifest.json").read_text())["entries"]) == 1
    second, port = start_server(["--affix-cache-dir", str(cache)])
    try:
        assert hits(port) == 0
        status, text = call(port, "POST", CH, body)  # the first request after the restart: checked
        assert status == 200
        # its check, the same request with reuse, is served from the loaded copy; it may end after the answer
        assert wait_until(lambda: hits(port) == 1, 30)
        after = json.loads(text)["choices"][0]
        assert (after["token_ids"], after["message"]["content"]) == (before["token_ids"], before["message"]["content"])
        status, text = call(port, "POST", "/v1/affixes/save", {})
        assert status == 200 and json.loads(text)["saved"] >= 1
    finally:
        second.terminate()
        second.wait(timeout=30)
