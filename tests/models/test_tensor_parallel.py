"""Tensor parallelism over gloo: two processes give the tokens one process gives (fp32), for both families,
with requests of mixed selectors, lengths and sampling arriving in one batch; and the clear refusals."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest

from acache import LLM, SamplingParams
from acache.engine.parallel import RankFault
from acache.models.config import ModelConfig
from acache.models.tensor_parallel import shard_config
from tests.affix.helpers import layouts
from tests.models import tp_faults


def mixed(block_causal: bool = False):
    """Eight requests, every layout (as a ``block_causal`` model reads them: see :func:`layouts`) and selector."""
    prompts = [layouts(seed=s, block_causal=block_causal)[k] for s in range(2)
               for k in ["prefix", "infix", "suffix", "two-affix"]]
    params = [SamplingParams(gen_length=(8, 16)[i % 2], block_length=8, threshold=0.5,
                             selector=(None, "attention", "cacheblend", "kv-deviation", "influence",
                                           "query-attention")[i % 6],
                             anchor_ratio=(0.2, 0.5)[i % 2], temperature=1.0 if i % 3 == 0 else 0.0, seed=i)
              for i in range(len(prompts))]
    return prompts, params


def test_two_ranks_give_the_tokens_of_one(family_dir):
    from acache.models.loader import read_config

    prompts, params = mixed(block_causal=read_config(family_dir)[0].block_causal)
    one = LLM(family_dir, kv_cache_memory=1 << 24, max_batch_size=3)
    first = one.generate(prompts, params, use_tqdm=False)
    want = [o.token_ids for o in first]
    two = LLM(family_dir, kv_cache_memory=1 << 24, max_batch_size=3, tensor_parallel_size=2)
    try:
        assert two.model.config.num_kv_heads == 1 and two.model.layers[0].q_proj.out_features == 32
        outs = two.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        # the attention selectors' sums over heads are complete on every rank, inside the refresh (one pass) as in a
        # pass of their own (the deviation ones are left out: on a block-causal model a prefix affix deviates by
        # rounding noise alone, ties in any order)
        anchors = [[o.stats.affix.anchors for o, p in zip(run, params, strict=True)
                    if p.selector in ("attention", "influence", "query-attention")] for run in (first, outs)]
        assert anchors[0] == anchors[1]
        # unseeded sampling added without a generator (as the server adds requests): every rank draws the same
        # noise, so the ranks stay in step; then a second call on the same ranks gives the first's tokens
        engine = two.engine
        for i in range(3):
            engine.add_request(prompts[i], SamplingParams(gen_length=16, block_length=8, temperature=1.0))
        while engine.has_unfinished():
            engine.step()
        assert [o.token_ids for o in two.generate(prompts[:3], params[:3], use_tqdm=False)] == want[:3]
    finally:
        two.close()
    assert all(not p.is_alive() for p in two._tp_workers) and two._tp_workers == []


@pytest.mark.parametrize("size, why", [(3, "does not divide the model's num_heads"), (0, "positive integer"),
                                       (True, "positive integer")])
def test_a_size_that_does_not_split_the_model_is_refused(llada_dir, size, why):
    with pytest.raises(ValueError, match=why):
        LLM(llada_dir, tensor_parallel_size=size)


def test_a_saved_affix_cache_is_refused_under_tensor_parallelism(llada_dir, tmp_path):
    with pytest.raises(ValueError, match="affix_cache_dir is not supported with tensor parallelism"):
        LLM(llada_dir, tensor_parallel_size=2, affix_cache_dir=tmp_path)


def test_a_shard_keeps_whole_heads_of_the_same_size():
    cfg = ModelConfig("llada", 256, 64, 2, 4, 2, 128, 10000.0, 1e-5, 512, 1, 2, 2)
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.head_dim) == (2, 1, 64, 16)
    with pytest.raises(ValueError, match="does not divide the model's num_kv_heads"):
        shard_config(cfg, 4)


def test_serve_with_two_ranks_answers_as_one(tmp_path):
    """``acache serve -tp 2`` on the shipped model: the single-process answers, streaming included; logprobs
    (scoring outside the engine) are refused with a clear 400; SIGTERM stops both ranks."""
    import json
    import signal
    import urllib.error
    import urllib.request

    from fastapi.testclient import TestClient

    from acache.paths import default_model
    from acache.server.app import create_app
    from tests.server.helpers import start_server

    story = "story : mary moved to the kitchen . john went to the garden ."
    bodies = [{"prompt": f"{story} question : where is {who} ? answer :", "max_tokens": n}
              for who, n in (("mary", 2), ("john", 4))]
    with TestClient(create_app(LLM(default_model(), kv_cache_memory=1 << 24), "tiny")) as client:
        single = [client.post("/v1/completions", json=b).json()["choices"][0] for b in bodies]
    want = [c["text"] for c in single]
    proc, port = start_server(["--tensor-parallel-size", "2", "--kv-cache-memory", "16MiB"])

    def post(body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        got = [json.loads(post(b)[1])["choices"][0] for b in bodies]
        assert [c["token_ids"] for c in got] == [c["token_ids"] for c in single]  # special tokens included
        assert [c["text"] for c in got] == want
        status, text = post({**bodies[1], "stream": True})
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want[1]
        status, text = post({**bodies[0], "logprobs": 1})
        assert status == 400 and "not supported with --tensor-parallel-size > 1" in text
        ranks = [int(line.split()[0]) for line in _children(proc.pid)]
        assert len(ranks) == 1  # rank 1, spawned by the server
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # uvicorn shuts down gracefully (rank 1 told to stop), then re-raises SIGTERM
    deadline = time.time() + 30
    while any(_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in ranks)


def _children(pid: int) -> list[str]:
    """``/proc`` stat lines of the processes whose parent is ``pid`` (but not the resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            line = stat.read_text()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(line.rsplit(")", 1)[1].split()[1]) == pid and b"resource_tracker" not in cmd:
            out.append(line)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_two_ranks_take_a_bicache_profile_and_a_worker_ignores_ctrl_c(llada_dir, tmp_path):
    """The profile is checked against the whole model, as it was made (a shard's fingerprint is another); a worker
    outlives the Ctrl-C the terminal sends every process, so rank 0 still decides when it stops."""
    import os
    import signal

    from acache.affix.bicache import BiCacheProfile
    from acache.affix.persistence import model_fingerprint
    from acache.models.loader import load_model

    path = BiCacheProfile(num_layers=2, tau=0.97, max_share=[0.5, 1.0], safe_layers=[1, 0], samples=[1, 1],
                          model_fingerprint=model_fingerprint(load_model(llada_dir))).save(tmp_path / "profile.json")
    prompts, _ = mixed()
    params = [SamplingParams(gen_length=8, block_length=8, threshold=0.5, selector="bicache-profiled"),
              SamplingParams(gen_length=16, block_length=8, threshold=0.5, selector="attention", anchor_ratio=0.5)]
    want = LLM(llada_dir, kv_cache_memory=1 << 24, bicache_profile=path).generate(prompts[:2], params,
                                                                                   use_tqdm=False)
    two = LLM(llada_dir, kv_cache_memory=1 << 24, tensor_parallel_size=2, bicache_profile=path)
    try:
        os.kill(two._tp_workers[0].pid, signal.SIGINT)
        time.sleep(0.5)
        assert two._tp_workers[0].is_alive()
        got = two.generate(prompts[:2], params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finally:
        two.close()


def test_close_stops_the_ranks_when_telling_them_fails(llada_dir, monkeypatch):
    two = LLM(llada_dir, kv_cache_memory=1 << 24, tensor_parallel_size=2)
    workers = list(two._tp_workers)

    def broken(call):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(two._channel, "send", broken)
    two.close()
    assert two._tp_workers == [] and all(not p.is_alive() for p in workers)
    again = LLM(llada_dir, kv_cache_memory=1 << 24, tensor_parallel_size=2)  # the group was left: a new one forms
    try:
        assert again.generate([[1, 2, 3]], SamplingParams(gen_length=8, block_length=8), use_tqdm=False)[0].token_ids
    finally:
        again.close()


def test_close_ends_a_rank_that_is_alive_but_does_not_take_the_stop(llada_dir, monkeypatch):
    monkeypatch.setattr("acache.llm.STOP_GRACE_S", 0.5)
    two = LLM(llada_dir, kv_cache_memory=1 << 24, tensor_parallel_size=2)
    workers = list(two._tp_workers)
    monkeypatch.setattr(two._channel, "send", lambda call: time.sleep(3600))  # stuck, not gone
    began = time.monotonic()
    two.close()
    assert time.monotonic() - began < 30 and all(not p.is_alive() for p in workers)
    with pytest.raises(RuntimeError, match="was closed"):
        assert two.engine is None  # reading it raises


def test_ctrl_c_in_an_offline_generate_ends_the_ranks_at_once(llada_dir, monkeypatch):
    """Rank 0 may be interrupted between two collectives of a forward: the other ranks wait inside one, so they are
    ended rather than sent aborts they would never read."""
    two = LLM(llada_dir, kv_cache_memory=1 << 24, tensor_parallel_size=2)
    workers = list(two._tp_workers)
    engine = two.engine

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "step", interrupted)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        two.generate([[1, 2, 3], [4, 5]], SamplingParams(gen_length=8, block_length=8), use_tqdm=False)
    assert time.monotonic() - began < 30 and all(not p.is_alive() for p in workers) and two._tp_workers == []


@pytest.mark.parametrize("where", ["step", "add"])
def test_a_fault_on_one_rank_alone_stops_serving_and_hangs_nothing(llada_dir, monkeypatch, where):
    """Rank 1 alone fails its second step (after the forward) or its second add: rank 0 raises RankFault for that
    call and at once for every later one, sending the others nothing that would meet them at a collective of
    another batch, and the ranks still stop."""
    monkeypatch.setattr("acache.llm._tp_worker", functools.partial(tp_faults.faulty_worker, where))
    two = LLM(llada_dir, kv_cache_memory=1 << 24, max_batch_size=3, tensor_parallel_size=2)
    workers = list(two._tp_workers)
    prompts, params = mixed()
    try:
        began = time.monotonic()
        with pytest.raises(RankFault, match="ended an engine call differently"):
            two.generate(prompts[:4], params[:4], use_tqdm=False)
        assert two.engine.fault is not None
        with pytest.raises(RankFault):
            two.generate(prompts[4:5], params[4:5], use_tqdm=False)
        assert time.monotonic() - began < 60 and all(p.is_alive() for p in workers)
        assert not two.engine.has_unfinished()  # rank 0's own requests were freed
    finally:
        two.close()
    assert all(not p.is_alive() for p in workers) and two._tp_workers == []


def test_more_ranks_than_gpus_are_refused_before_any_is_spawned(llada_dir, monkeypatch):
    """On CUDA each rank takes GPU ``rank``: a rank past the last GPU died alone, and rank 0 waited out the group's
    10-minute timeout for it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 runs one rank a GPU, and this machine has 1 CUDA"):
        LLM(llada_dir, device="cuda", tensor_parallel_size=2)



def test_a_rank_that_ends_before_joining_is_an_error_at_once(llada_dir, tmp_path):
    """A script that builds a tensor-parallel LLM outside ``if __name__ == "__main__":``: the spawned rank imports
    it, fails to spawn ranks of its own, and ends. Rank 0 waited out the group's 10-minute timeout for it; now it
    says which rank ended, and why that happens, as soon as the rank is gone."""
    import subprocess
    import sys

    script = tmp_path / "no_main_guard.py"
    script.write_text("from acache import LLM\n"
                      f"LLM({str(llada_dir)!r}, kv_cache_memory=1 << 24, tensor_parallel_size=2)\n")
    began = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode != 0
    assert "tensor-parallel rank 1 ended (exit code 1) before it joined the group" in done.stderr
    assert 'outside `if __name__ == "__main__":`' in done.stderr
    assert time.monotonic() - began < 240  # not the group's 10 minutes
