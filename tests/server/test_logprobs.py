"""echo + logprobs (what lm-eval's loglikelihood requests send), chat logprobs, and the tokenizer endpoints a
remote client tokenizes with, on the shipped model."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from acache import LLM
from acache.scoring import continuation_logprob, split_estimates
from acache.server.app import create_app
from acache_lab.tasks.generators import PLACES, held_out

STORY = "story : mary moved to the kitchen . john went to the garden . question : where is mary ? answer :"
SAMPLES = 8
# the same draws forwarded in batches of other sizes (distinct rows are shared, sorted and batched per
# request): float-close, not bit-equal, as a CPU's matmul kernels block a batch by its size
SAME_DRAWS = 1e-5


@pytest.fixture(scope="module")
def setup():
    from acache.paths import default_model

    llm = LLM(default_model(), kv_cache_memory=1 << 24)
    with TestClient(create_app(llm, "tiny", loglikelihood_samples=SAMPLES)) as client:
        yield client, llm


@pytest.fixture(scope="module")
def own_llm():
    """An LLM no app serves yet, for a test that builds an app of its own: an LLM is served by one app at a time."""
    from acache.paths import default_model

    return LLM(default_model(), kv_cache_memory=1 << 24)


def post(client, path, body):
    resp = client.post(path, json=body)
    return resp.status_code, resp.json()


def lm_eval_loglikelihood_payload(ids_batch):
    """What lm-eval 0.4's local-completions sends for loglikelihood requests with a tokenizer: context and
    continuation as one token-id prompt, echo, one top logprob, one generated token (which it drops)."""
    return {"model": "tiny", "prompt": ids_batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def lm_eval_slice(choice, ctxlen):
    """lm-eval's reading of the answer: the sum of the token values after the context, without the last."""
    values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(values), all(v == max(t.values()) for v, t in zip(values, tops, strict=True))


def test_lm_eval_loglikelihood_requests_get_the_paper_estimate(setup):
    client, llm = setup
    ctx = llm.tokenizer.encode(STORY)
    conts = [llm.tokenizer.encode(" " + p) for p in ("kitchen", "garden", "office")]
    status, out = post(client, "/v1/completions", lm_eval_loglikelihood_payload([ctx + c for c in conts]))
    assert status == 200, out
    scores = []
    for choice, cont in zip(out["choices"], conts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1 == len(lp["tokens"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        total, _ = lm_eval_slice(choice, len(ctx))
        want = continuation_logprob(llm.model, ctx, cont, SAMPLES, torch.Generator().manual_seed(1234))
        assert total == pytest.approx(want, abs=SAME_DRAWS)
        scores.append(total)
    assert scores[0] == max(scores)  # mary is in the kitchen


def test_score_only_echo_and_every_split(setup):
    client, llm = setup
    ids = llm.tokenizer.encode(STORY + " kitchen")
    status, out = post(client, "/v1/completions", {"prompt": STORY + " kitchen", "max_tokens": 0, "echo": True,
                                                   "logprobs": 0, "seed": 5, "mc_samples": 3})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == STORY + " kitchen" and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    values = choice["logprobs"]["token_logprobs"]
    assert choice["logprobs"]["top_logprobs"] is None and len(values) == len(ids)
    want = split_estimates(llm.model, ids, range(1, len(ids)), 3, torch.Generator().manual_seed(5))
    for c in (1, len(ids) // 2, len(ids) - 1):
        assert sum(values[c:]) == pytest.approx(want[c - 1], abs=SAME_DRAWS)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    offsets, pieces = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert all(STORY[o:o + len(p)] == p for o, p in zip(offsets[:-1], pieces[:-1], strict=True))


def test_seed_and_samples_steer_the_estimate(setup):
    client, _ = setup
    def values(**kw):
        body = {"prompt": STORY + " kitchen", "max_tokens": 0, "echo": True, "logprobs": 0, **kw}
        return post(client, "/v1/completions", body)[1]["choices"][0]["logprobs"]["token_logprobs"]
    assert values(seed=1) == values(seed=1) != values(seed=2)
    assert values(seed=1) != values(seed=1, mc_samples=2)
    assert values() == values(seed=0)  # no seed: seed 0, so a score is reproducible


def test_generated_tokens_logprobs(setup):
    client, llm = setup
    status, out = post(client, "/v1/completions", {"prompt": STORY, "max_tokens": 2, "logprobs": 2, "seed": 3})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == "kitchen"
    lp = choice["logprobs"]
    # the EOS that ended the answer is reported too, as itself, as lm-eval expects
    eos = llm.tokenizer.decode([llm.config.eos_token_id], skip_special_tokens=False)
    assert lp["tokens"] == ["kitchen", eos] and eos and all(len(t) == 2 for t in lp["top_logprobs"])
    ctx = llm.tokenizer.encode(STORY)
    want = continuation_logprob(llm.model, ctx, choice["token_ids"] + [llm.config.eos_token_id], SAMPLES,
                                torch.Generator().manual_seed(3))
    assert sum(lp["token_logprobs"]) == pytest.approx(want, abs=SAME_DRAWS)
    assert max(lp["top_logprobs"][0], key=lp["top_logprobs"][0].get) == "kitchen"


def test_chat_logprobs(setup):
    client, llm = setup
    body = {"messages": [{"role": "system", "content": "mary moved to the kitchen . john went to the garden ."},
                         {"role": "user", "content": "where is john ?"}],
            "max_tokens": 2, "logprobs": True, "top_logprobs": 3, "selector": "off", "seed": 4}
    status, out = post(client, "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "garden" and [c["token"] for c in content] == ["garden"]
    assert len(content[0]["top_logprobs"]) == 3 and content[0]["bytes"] == list(b"garden")
    prompt = llm.chat_prompt([m for m in body["messages"]])
    want = continuation_logprob(llm.model, prompt.token_ids, choice["token_ids"], SAMPLES,
                                torch.Generator().manual_seed(4))
    assert content[0]["logprob"] == pytest.approx(want, abs=SAME_DRAWS)
    status, out = post(client, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0})
    assert status == 200 and out["choices"][0]["logprobs"] is None


def test_multiple_choice_through_the_server_beats_chance(setup):
    """Every place as a choice: the answer scored highest is the right one far more often than 1 in 8."""
    client, llm = setup
    right = 0
    examples = held_out("qa1", 12, 6)
    for e in examples:
        ctx = llm.tokenizer.encode(f"story : {' '.join(e.affix)} question : {' '.join(e.question)} answer :")
        prompts = [ctx + llm.tokenizer.encode(p) for p in PLACES]
        out = post(client, "/v1/completions", lm_eval_loglikelihood_payload(prompts))[1]
        scores = [lm_eval_slice(c, len(ctx))[0] for c in out["choices"]]
        right += PLACES[scores.index(max(scores))] == e.answer[0]
    assert right >= 10


@pytest.mark.parametrize("body, message", [
    ({"prompt": STORY, "max_tokens": 0}, "only with echo=true"),
    ({"prompt": STORY, "max_tokens": 0, "echo": True, "stream": True}, "nothing to stream"),
    ({"prompt": STORY, "max_tokens": 2, "logprobs": 1, "stream": True}, "use stream=false"),
    ({"prompt": STORY, "max_tokens": 2, "logprobs": 21}, "less than or equal to 20"),
    ({"prompt": STORY, "max_tokens": 2, "logprobs": -1}, "greater than or equal to 0"),
    ({"prompt": STORY, "max_tokens": -1, "echo": True}, "greater than or equal to 0"),
    ({"prompt": STORY, "max_tokens": 2, "mc_samples": 4}, "pass logprobs too"),
    ({"prompt": STORY, "max_tokens": 2, "logprobs": 1, "mc_samples": 0}, "greater than or equal to 1"),
    ({"prompt": STORY, "max_tokens": 2, "logprobs": 1, "mc_samples": 5000}, "less than or equal to 1024"),
    ({"prompt": "question : where is mary ? answer :", "suffix": "story : mary moved to the kitchen .",
      "max_tokens": 2, "logprobs": 1}, "suffix (infilling) are not implemented"),
    ({"prompt": [5, 500], "max_tokens": 0, "echo": True, "logprobs": 1}, "not in the model's vocabulary"),
    ({"prompt": [5] * 300, "max_tokens": 0, "echo": True, "logprobs": 1}, "exceed the context"),
])
def test_bad_logprobs_requests(setup, body, message):
    client, _ = setup
    status, out = post(client, "/v1/completions", body)
    assert status == 400 and message in out["error"]["message"], out


def test_bad_chat_logprobs_requests(setup):
    client, _ = setup
    base = {"messages": [{"role": "user", "content": "where is mary ?"}], "max_tokens": 2}
    for extra, message in [({"mc_samples": 3}, "pass logprobs=true too"),
                           ({"logprobs": True, "stream": True}, "use stream=false"),
                           ({"top_logprobs": 1}, "needs logprobs=true")]:
        status, out = post(client, "/v1/chat/completions", {**base, **extra})
        assert status == 400 and message in out["error"]["message"], out


def test_tokenizer_endpoints_a_remote_client_uses(setup):
    client, llm = setup
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == llm.tokenizer.eos_token and info["chat_template"] == llm.tokenizer.chat_template
    assert info["model_max_length"] == llm.max_model_len
    status, out = post(client, "/tokenize", {"prompt": "Where is Mary?", "add_special_tokens": False})
    assert status == 200 and out["tokens"] == llm.tokenizer.encode("where is mary ?")
    status, back = post(client, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": "where is mary ?"}
    status, chat = post(client, "/tokenize", {"messages": [{"role": "user", "content": "where is mary ?"}],
                                              "add_generation_prompt": False})
    assert status == 200 and post(client, "/detokenize", {"tokens": chat["tokens"]})[1]["prompt"].endswith("?")
    for body, code, message in [({"tokens": [1, 10**6]}, 400, "outside the vocabulary"),
                                ({"tokens": "x"}, 400, "tokens"),
                                ({"tokens": [1], "model": "other"}, 404, "not served here")]:
        status, out = post(client, "/detokenize", body)
        assert status == code and message in out["error"]["message"], out


def test_echo_with_a_registered_affix_echoes_what_it_scores(setup):
    client, llm = setup
    story = "story : mary moved to the kitchen . john went to the garden ."
    affix = post(client, "/v1/affixes", {"text": story})[1]["id"]
    status, out = post(client, "/v1/completions", {"prompt": " question : where is john ? answer :", "affix": affix,
                                                   "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, out
    choice = out["choices"][0]
    want = llm.tokenizer.encode(story) + llm.tokenizer.encode(" question : where is john ? answer :")
    assert len(choice["logprobs"]["token_logprobs"]) == len(want)
    assert choice["text"] == llm.tokenizer.decode(want) and choice["text"].startswith("story :")
    assert isinstance(client.get("/tokenizer_info").json()["pad_token"], str)


def test_prompts_scored_in_one_request_get_what_each_gets_alone(setup):
    """A request's prompts (and each prompt's continuation) share scoring forwards, each seeded as alone."""
    client, llm = setup
    ctx = llm.tokenizer.encode(STORY)
    prompts = [ctx + llm.tokenizer.encode(" " + p) for p in ("kitchen", "garden")] + [ctx[:-3]]
    _, together = post(client, "/v1/completions", lm_eval_loglikelihood_payload(prompts))
    for prompt, choice in zip(prompts, together["choices"], strict=True):
        _, alone = post(client, "/v1/completions", lm_eval_loglikelihood_payload([prompt]))
        mine, theirs = choice["logprobs"], alone["choices"][0]["logprobs"]
        assert mine["tokens"] == theirs["tokens"] and mine["token_logprobs"][0] is None
        assert mine["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=SAME_DRAWS)
        assert [list(t) for t in mine["top_logprobs"][1:]] == [list(t) for t in theirs["top_logprobs"][1:]]


def test_concurrent_scoring_requests_share_passes_and_get_what_each_gets_alone(setup):
    """Requests scoring at the same time (different prompts, seeds, draws and top-k, arriving apart) share
    forwards; each gets the values it gets alone."""
    import threading
    import time

    client, llm = setup
    ctx = llm.tokenizer.encode(STORY)
    bodies = [{**lm_eval_loglikelihood_payload([ctx + llm.tokenizer.encode(" " + place)]), "seed": seed,
               "mc_samples": samples, "logprobs": top}
              for place, seed, samples, top in (("kitchen", 1, 8, 1), ("garden", 2, 16, 0), ("office", 3, 4, 2),
                                                ("hallway", 4, 8, 1), ("kitchen", 5, 12, 3), ("cellar", 6, 8, 0))]
    alone = [post(client, "/v1/completions", body)[1] for body in bodies]
    shared = client.app.state.scorer.shared
    passes = shared.passes
    together: dict[int, dict] = {}

    def send(n: int) -> None:
        time.sleep(0.01 * n)
        together[n] = post(client, "/v1/completions", bodies[n])[1]

    threads = [threading.Thread(target=send, args=(n,)) for n in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n, want in enumerate(alone):
        mine, theirs = together[n]["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
        assert mine["tokens"] == theirs["tokens"]
        assert mine["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=SAME_DRAWS), n
        assert (mine["top_logprobs"] is None) == (theirs["top_logprobs"] is None)
    assert shared.passes - passes < len(bodies)  # some of them shared a pass


def test_a_shared_pass_stops_only_when_every_caller_gave_up():
    import threading

    from acache.server.logprobs import AllSet

    a, b = threading.Event(), threading.Event()
    both = AllSet([a, b])
    a.set()
    assert not both.is_set()
    b.set()
    assert both.is_set()
    assert not AllSet([a, None]).is_set()  # a caller that cannot cancel keeps the pass going


@pytest.mark.parametrize("prompt", [
    "story : mary moved to the kitchen.question : where is mary ? answer :",  # spelled otherwise than decoded
    "story : mary moved to the kitchen . question : where is mary ? answer :",
])
def test_text_offset_indexes_the_text_returned(setup, prompt):
    client, llm = setup
    status, out = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1})
    assert status == 200, out
    choice = out["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert len(lp["text_offset"]) == len(lp["tokens"]) and lp["text_offset"] == sorted(lp["text_offset"])
    special = {llm.tokenizer.decode([t], skip_special_tokens=False) for t in llm.stop_token_ids}
    spelled = [(o, p) for o, p in zip(lp["text_offset"], lp["tokens"], strict=True) if p not in special]
    assert len(spelled) >= len(lp["tokens"]) - 1 and all(text[o:o + len(p)] == p for o, p in spelled), spelled
    generated = [o for o in lp["text_offset"][-2:]]
    assert all(o >= len(prompt) for o in generated)  # the answer's tokens index the answer, after the prompt


def test_echo_with_stream_is_refused(setup):
    client, _ = setup
    status, out = post(client, "/v1/completions", {"prompt": STORY, "max_tokens": 2, "echo": True, "stream": True})
    assert status == 400 and "echo returns the prompt with the whole completion" in out["error"]["message"]


def test_a_prompt_holding_the_mask_token_is_not_scored(setup):
    client, llm = setup
    ids = [*llm.tokenizer.encode("where is mary ?"), llm.config.mask_token_id]
    status, out = post(client, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 400 and f"token id {llm.config.mask_token_id} is the model's mask token" in \
        out["error"]["message"]


def test_scoring_past_the_budget_is_refused_and_the_rest_is_scored(own_llm):
    llm = own_llm
    small = 30 * 16 * 8  # a 30-token prompt with 8 draws a split takes about 4,000 token positions
    with TestClient(create_app(llm, "tiny", loglikelihood_samples=SAMPLES, max_scoring_tokens=small)) as client:
        ids = llm.tokenizer.encode(STORY)
        status, out = post(client, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
                                                       "mc_samples": 64})
        assert status == 400 and "more than this server's --max-scoring-tokens of 3,840" in out["error"]["message"]
        status, out = post(client, "/v1/completions", {"prompt": ids[:12], "max_tokens": 0, "echo": True,
                                                       "logprobs": 1, "mc_samples": 4})
        assert status == 200, out


def test_top_tokens_that_spell_alike_keep_the_likelier_value():
    from acache.server.logprobs import Scorer

    class Spelling:  # two tokens with one text (a word and its added-token twin, say)
        def decode(self, ids, skip_special_tokens=True):
            return {1: "x", 2: "x", 3: "a"}[ids[0]]

    scorer = Scorer.__new__(Scorer)
    scorer.tokenizer = Spelling()
    assert scorer._named({3: -2.0, 2: -0.1, 1: -0.5}) == {"x": -0.1, "a": -2.0}
    assert list(scorer._named({3: -2.0, 2: -0.1, 1: -0.5})) == ["x", "a"]  # most likely first


def test_a_caller_that_gave_up_before_its_pass_costs_no_work():
    import threading

    from acache.scoring import ScoringCancelled
    from acache.server.logprobs import SharedPasses

    started, release, seen = threading.Event(), threading.Event(), []

    def run(jobs, cancel):
        seen.append(list(jobs))
        if len(seen) == 1:
            started.set()
            release.wait(5)
        return jobs

    shared = SharedPasses(run)
    gone, results = threading.Event(), {}

    def call(name, cancel=None):
        try:
            results[name] = shared([name], cancel)
        except ScoringCancelled as exc:
            results[name] = exc

    first = threading.Thread(target=call, args=("a",))
    first.start()
    started.wait(5)
    gone.set()
    later = [threading.Thread(target=call, args=("b", gone)), threading.Thread(target=call, args=("c",))]
    for t in later:
        t.start()
    later[0].join(5)  # gave up while queued: it leaves at once, not at the pass's end
    assert isinstance(results["b"], ScoringCancelled) and not release.is_set()
    while len(shared._waiting) < 1:
        threading.Event().wait(0.01)
    release.set()
    for t in (first, *later):
        t.join(5)
    assert seen == [["a"], ["c"]] and isinstance(results["b"], ScoringCancelled) and results["c"] == ["c"]


def test_byte_pieces_of_one_character_are_named_by_their_bytes(llada_dir):
    """A byte-level vocabulary (the random checkpoints', as Qwen's and GPT-2's) splits 'é' into two tokens whose
    text alone is the replacement character: they are reported by their bytes, as OpenAI does."""
    from acache.server.logprobs import Scorer

    llm = LLM(llada_dir)
    scorer = Scorer(llm.model, llm.tokenizer, samples=2)
    prompt = llm.tokenizer.encode("where ?", add_special_tokens=False)
    accent = llm.tokenizer.encode("é", add_special_tokens=False)
    assert [scorer.piece(t) for t in accent] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert llm.tokenizer.token_bytes(-1) == llm.tokenizer.token_bytes(10**9) == b""  # no token: no bytes
    content = scorer.chat(prompt, accent, top_k=2, seed=0, samples=2)["content"]
    assert [c["bytes"] for c in content] == [[0xC3], [0xA9]] and bytes(sum((c["bytes"] for c in content), [])) \
        == "é".encode()
    assert all(len(c["top_logprobs"]) == 2 and all(isinstance(t["bytes"], list) for t in c["top_logprobs"])
               for c in content)


def test_a_caller_that_gives_up_mid_pass_has_its_rows_left_out_and_the_others_go_on(setup):
    """A pass shared with a small request ran a cancelled large one to its end (67 forwards in the reviewer's case),
    and the small request waited for all of it."""
    import contextlib
    import threading

    from acache.scoring import ScoreJob, score_jobs

    _, llm = setup
    ids = llm.tokenizer.encode(STORY)
    small_ids = ids[:10]

    def jobs(cancel=None):
        big = ScoreJob(ids, 1, 16, torch.Generator().manual_seed(1), 0, cancel)
        small = ScoreJob(small_ids, 8, 2, torch.Generator().manual_seed(2))
        beside = ScoreJob(ids, 20, 3, torch.Generator().manual_seed(3), 2)  # the big one's length: shared forwards
        return [big, small, beside]

    forwards = []

    class Counting(contextlib.AbstractContextManager):
        """The engine lock's place: held around each forward, so it counts them."""

        def __enter__(self):
            forwards.append(1)
            if len(forwards) == 2:
                gone.set()  # the big job's caller gives up during the second forward

        def __exit__(self, *exc):
            return None

    gone = threading.Event()
    alone = score_jobs(llm.model, jobs()[1:], batch_size=4)
    full_run = score_jobs(llm.model, jobs(), batch_size=4, lock=Counting())
    everything, forwards[:] = len(forwards), []
    gone.clear()
    big, small, beside = score_jobs(llm.model, jobs(gone), batch_size=4, lock=Counting())
    assert big is None and full_run[0] is not None
    for got, want in ((small, alone[0]), (beside, alone[1])):  # the same-length job's rows too, top tokens included
        torch.testing.assert_close(torch.tensor(got.values), torch.tensor(want.values), rtol=0, atol=1e-5)
        assert [list(t) for t in got.top] == [list(t) for t in want.top]
    assert len(forwards) < everything / 2  # the rest of the big job's rows never ran


def test_a_caller_queued_behind_a_pass_that_gives_up_is_freed_at_once():
    import threading
    import time

    from acache.scoring import ScoringCancelled
    from acache.server.logprobs import SharedPasses

    started, release = threading.Event(), threading.Event()

    def run(jobs, cancel):
        started.set()
        release.wait(10)
        return jobs

    shared = SharedPasses(run)
    first = threading.Thread(target=shared, args=(["a"],))
    first.start()
    started.wait(5)
    gone, outcome = threading.Event(), []

    def queued():
        try:
            outcome.append(shared(["b"], gone))
        except ScoringCancelled as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=queued)
    waiter.start()
    while not shared._waiting:
        time.sleep(0.01)
    began = time.monotonic()
    gone.set()
    waiter.join(5)
    assert isinstance(outcome[0], ScoringCancelled) and time.monotonic() - began < 1 and not release.is_set()
    release.set()
    first.join(5)
    assert shared._waiting == []


def counted_generate(monkeypatch, engine) -> list:
    """The engine's decodes from now on, one entry each (the list fills as they start)."""
    real, calls = engine.generate, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", counting)
    return calls


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_whose_scoring_is_refused_is_refused_before_it_decodes(setup, own_llm, monkeypatch, path):
    """A prompt holding the mask token, or an echoed prompt whose scoring alone is past the budget, was decoded to
    the end before the 400."""
    client, llm = setup
    calls = counted_generate(monkeypatch, client.app.state.engine)
    mask = llm.tokenizer.decode([llm.config.mask_token_id], skip_special_tokens=False)
    if path == "/v1/completions":
        body = {"prompt": f"where is mary {mask} ?", "max_tokens": 8, "logprobs": 0}
    else:
        body = {"messages": [{"role": "user", "content": f"where is mary {mask} ?"}], "max_tokens": 8,
                "logprobs": True}
    status, out = post(client, path, body)
    assert status == 400 and "is the model's mask token" in out["error"]["message"] and calls == []
    if path == "/v1/completions":
        ids = llm.tokenizer.encode(STORY)
        with TestClient(create_app(own_llm, "tiny", loglikelihood_samples=SAMPLES,
                                   max_scoring_tokens=30 * 16 * 8)) as c:
            calls = counted_generate(monkeypatch, c.app.state.engine)
            status, out = post(c, path, {"prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 0,
                                         "mc_samples": 64})
            assert status == 400 and "--max-scoring-tokens" in out["error"]["message"] and calls == []
            status, out = post(c, path, {"prompt": ids[:12], "max_tokens": 2, "echo": True, "logprobs": 0,
                                         "mc_samples": 2})
            assert status == 200 and calls == [1]  # a request within the budget still decodes and is scored


def test_a_caller_another_took_into_its_pass_that_gives_up_is_cancelled_not_a_500():
    """Its rows are already left out of the pass: it leaves with ScoringCancelled (a ValueError from the queue, a
    500 at shutdown, before)."""
    import threading
    import time

    from acache.scoring import ScoringCancelled
    from acache.server.logprobs import SharedPasses

    began = [threading.Event(), threading.Event()]
    ends = [threading.Event(), threading.Event()]
    passes = []

    def run(jobs, cancel):
        n = len(passes)
        passes.append(list(jobs))
        began[n].set()
        ends[n].wait(10)
        return jobs

    shared = SharedPasses(run)
    outcome: dict = {}

    def call(name, cancel=None):
        try:
            outcome[name] = shared([name], cancel)
        except BaseException as exc:  # noqa: BLE001 (what it raises is the point)
            outcome[name] = exc

    gone = threading.Event()
    threads = [threading.Thread(target=call, args=args) for args in (("a",), ("b",), ("c", gone))]
    threads[0].start()
    began[0].wait(5)
    for queued, t in enumerate(threads[1:], start=1):
        t.start()
        while len(shared._waiting) < queued:
            time.sleep(0.01)
    ends[0].set()  # a's pass ends; b or c runs the next with both
    began[1].wait(5)
    gone.set()  # c gives up inside that pass: it leaves at once, unless it is the one running it (b waits on it)
    threads[2].join(2)
    runner = threads[2].is_alive()
    ends[1].set()
    for t in threads:
        t.join(5)
    assert isinstance(outcome["c"], ScoringCancelled), outcome
    assert passes == [["a"], ["b", "c"]] and outcome["a"] == ["a"] and outcome["b"] == ["b"], (passes, runner)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_scoring_an_answer_past_the_budget_is_refused_before_it_decodes(own_llm, monkeypatch, path):
    """Only echoed prompts were counted before decoding: the answer's own scoring, sized by max_tokens, was
    refused after the whole answer decoded (a chat's always), and the message said to score a shorter prompt."""
    llm = own_llm
    ids = llm.tokenizer.encode("where is mary ?")
    with TestClient(create_app(llm, "tiny", loglikelihood_samples=SAMPLES, max_scoring_tokens=20_000)) as c:
        calls = counted_generate(monkeypatch, c.app.state.engine)
        if path == "/v1/completions":
            body = {"prompt": ids, "max_tokens": 16, "logprobs": 1, "mc_samples": 1024, "ignore_eos": True}
        else:
            body = {"messages": [{"role": "user", "content": "where is mary ?"}], "max_tokens": 16,
                    "logprobs": True, "mc_samples": 1024, "ignore_eos": True}
        status, out = post(c, path, body)
        assert status == 400 and "lower mc_samples, max_tokens or the prompt's length" in out["error"]["message"]
        assert calls == []
        status, out = post(c, path, {**body, "mc_samples": 4, "max_tokens": 4})
        assert status == 200 and calls == [1], out  # within the budget: decoded and scored


def test_logprobs_say_the_tokens_were_decoded_without_reuse_when_reuse_was_off(setup):
    client, _ = setup
    affix = post(client, "/v1/affixes", {"text": "story : mary moved to the kitchen ."})[1]["id"]
    body = {"prompt": " question : where is mary ? answer :", "affix": affix, "max_tokens": 2, "logprobs": 1}
    said = {}
    for reuse in ("off", "always"):
        status, out = post(client, "/v1/completions", {**body, "affix_reuse": reuse})
        assert status == 200, out
        said[reuse] = (out["usage"]["affix_reuse"]["decision"], out["usage"]["affix_reuse"]["logprobs"])
    assert said["off"] == ("none", "estimated over the full context without reuse, as the tokens were decoded")
    assert said["always"] == ("reused", "estimated over the full context without reuse; the tokens were decoded "
                                       "with reuse")
