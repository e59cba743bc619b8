"""Bounded shutdown: in-flight work (decoding, streaming, scoring) gets the grace period, then a clean 503;
SIGTERM during a long scoring request ends the process within the grace period."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from acache import LLM
from acache.cli import build_parser
from acache.paths import SHIPPED_MODEL
from acache.server.app import create_app
from acache.server.serving import OpenAIServing
from acache.server.shutdown import Drain, ShuttingDown
from tests.conftest import tiny_checkpoint
from tests.server.helpers import start_server, wait_until

# about 8 s alone on a quiet 2-core machine (480 tokens took 1.2 s there, and once finished inside the 0.5 s grace):
# still running at the deadline however fast the machine
LONG = {"max_tokens": 1984, "steps": 1984}
SCORED = {"prompt": list(range(1, 65)), "max_tokens": 0, "echo": True, "logprobs": 0, "mc_samples": 1024}


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """The random test model with room for LONG's canvas."""
    return tiny_checkpoint(tmp_path_factory.mktemp("llada-long"), "llada", max_seq_len=4096)


def signalled_while_asked(proc, port: int, body: dict, signals: list[int]) -> tuple[dict, float]:
    """Sends ``body`` to the server ``proc``, then, 1.5 s into it, ``signals`` half a second apart; returns the
    answer (status and body) and the seconds from the first signal to the process's exit."""
    answer: dict[str, object] = {}

    def ask() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer["status"], answer["body"] = resp.status, json.loads(resp.read())

    client = threading.Thread(target=ask)
    try:
        client.start()
        time.sleep(1.5)  # the request is running
        began = time.time()
        for n, sig in enumerate(signals):
            time.sleep(0.5 if n else 0.0)
            proc.send_signal(sig)
        proc.wait(timeout=60)
        elapsed = time.time() - began
        client.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    return answer, elapsed


def test_in_flight_requests_get_a_503_once_the_grace_period_ends(long_dir):
    llm = LLM(long_dir, kv_cache_memory=1 << 24)
    results: dict[str, object] = {}
    with TestClient(create_app(llm, "tiny")) as client:
        def post(name: str, delay: float, path: str, body: dict) -> None:
            time.sleep(delay)
            results[name] = client.post(path, json=body)

        def stream(delay: float) -> None:
            time.sleep(delay)
            with client.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "stream": True,
                                                                 "block_length": 16, **LONG}) as resp:
                results["stream"] = [line for line in resp.iter_lines() if line.startswith("data: ")]

        jobs = [threading.Thread(target=post, args=("short", 0.0, "/v1/completions",
                                                    {"prompt": [1, 2, 3], "max_tokens": 8})),
                threading.Thread(target=post, args=("long", 0.05, "/v1/completions", {"prompt": [4, 5], **LONG})),
                threading.Thread(target=stream, args=(0.1,)),
                threading.Thread(target=post, args=("scored", 0.15, "/v1/completions", SCORED))]
        for job in jobs:
            job.start()
        assert wait_until(lambda: "short" in results and llm.engine.num_running >= 2, 30, poll=0.02)
        time.sleep(0.3)  # the scoring job has started
        began = time.time()
        client.app.state.drain.begin(0.5)
        health = client.get("/health")
        for job in jobs:
            job.join(timeout=30)
        elapsed = time.time() - began
        late = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 8})
    assert health.status_code == 503 and health.json()["status"] == "shutting down"
    assert results["short"].status_code == 200  # done before the deadline: answered as usual
    for name in ("long", "scored"):
        resp = results[name]
        assert resp.status_code == 503, (name, resp.text)
        assert resp.json()["error"]["code"] == "shutting_down" and "--shutdown-grace" in resp.json()["error"]["message"]
    events = results["stream"]
    assert events[-1] == "data: [DONE]" and "the server shut down" in json.loads(events[-2][6:])["error"]["message"]
    assert elapsed < 5.0  # the grace period, not the requests' own length (about 8 s) or the scoring's (minutes)
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0


def test_the_drain_starts_once_and_cancels_what_arrives_after():
    told: list[ShuttingDown] = []
    drain = Drain(told.append)
    with pytest.raises(ValueError, match="grace period must be >= 0"):
        drain.begin(-1)
    early = threading.Event()
    drain.track(early)
    drain.begin(0.05)
    drain.begin(100)  # a second signal does not extend it
    assert wait_until(lambda: bool(told), 5, poll=0.01) and early.is_set()
    late = threading.Event()
    drain.track(late)
    assert late.is_set() and len(told) == 1 and "0.05 s after the shutdown began" in str(told[0])


def test_the_grace_left_is_zero_before_the_drain_and_after_it():
    drain = Drain(lambda exc: None)
    assert drain.remaining() == 0.0  # a shutdown no signal began waits for nothing
    drain.begin(60)
    assert 59 < drain.remaining() <= 60
    drain.expire()
    assert drain.remaining() == 0.0


@pytest.mark.parametrize(("grace", "lasts", "finished"), [(10.0, 0.3, True), (0.3, 30.0, False), (0.0, 0.3, False)])
def test_a_reuse_check_running_at_shutdown_gets_what_is_left_of_the_grace(llada_dir, grace, lasts, finished):
    """A check outlives its answer; the shutdown waits for it within the grace period and cancels it after."""
    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    app = create_app(llm, "tiny")
    ended: list[str] = []

    async def check() -> None:
        try:
            await asyncio.sleep(lasts)
            ended.append("finished")
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def start() -> None:
        task = asyncio.ensure_future(check())
        app.state.checks_running.add(task)
        task.add_done_callback(app.state.checks_running.discard)

    with TestClient(app) as client:
        client.portal.call(start)
        app.state.drain.begin(grace)
        began = time.monotonic()
    elapsed = time.monotonic() - began
    assert ended == ["finished" if finished else "cancelled"]
    assert elapsed < (lasts if finished else grace) + 5.0


def test_an_affix_a_check_is_computing_at_shutdown_is_saved(tmp_path, monkeypatch):
    """The second sight of a system prompt starts a check, whose request with reuse computes the shared affix; here
    it starts half a second late, so it is still running when the shutdown begins right after the answer: the
    shutdown waits for it and saves the affix (before, the check was cancelled first and nothing was saved)."""
    real = OpenAIServing.final_output

    async def late_checks(self, prompt, params, check=None):
        if check is None and prompt.affixes:  # the check's request (the answer's own prompt has no affix)
            await asyncio.sleep(0.5)
        return await real(self, prompt, params, check)

    monkeypatch.setattr(OpenAIServing, "final_output", late_checks)
    cache = tmp_path / "affixes"
    llm = LLM(SHIPPED_MODEL, page_size=8)
    chat = {"messages": [{"role": "system", "content": "mary moved to the kitchen . john went to the garden ."},
                         {"role": "user", "content": "where is john?"}], "max_tokens": 2}
    with TestClient(create_app(llm, "acache-tiny", affix_cache_dir=cache)) as client:
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        second = client.post("/v1/chat/completions", json=chat)
        assert second.json()["usage"]["affix_reuse"]["decision"] == "checking"
        assert client.app.state.checks_running  # still running when its answer came back
        client.app.state.drain.begin(30)
    assert client.app.state.counters["auto_reuse_checking_total"] == 1 and not client.app.state.checks_running
    assert client.app.state.gate.totals["checks"] == 1  # it ran to its end and was recorded
    assert len(LLM(SHIPPED_MODEL, page_size=8, affix_cache_dir=cache).engine.affixes) == 1


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_shutdown_grace_is_named(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--shutdown-grace", value])
    assert f"argument --shutdown-grace: not a non-negative number of seconds: '{value}'" in capsys.readouterr().err


def test_sigterm_during_scoring_exits_within_the_grace_period(llada_dir):
    proc, port = start_server(["--model", str(llada_dir), "--shutdown-grace", "2"])
    answer, elapsed = signalled_while_asked(proc, port, SCORED, [signal.SIGTERM])  # scoring: it would take minutes
    assert elapsed < 2 + 8, f"exited {elapsed:.1f} s after SIGTERM with a 2 s grace period"
    assert answer["status"] == 503 and answer["body"]["error"]["code"] == "shutting_down"


def test_a_signal_that_lands_while_the_drain_is_locked_does_not_hang():
    """uvicorn starts the drain from a Python signal handler, which runs on the main thread between two bytecodes:
    one that lands while that thread holds the drain's lock (a scoring request tracking its cancel event) must
    not wait for the lock it holds. Run apart, so that a hang fails the test instead of stopping the suite."""
    code = (
        "import signal\n"
        "from acache.server.shutdown import Drain\n"
        "drain = Drain(lambda exc: None)\n"
        "signal.signal(signal.SIGUSR1, lambda *_: drain.begin(60))\n"
        "with drain._lock:\n"
        "    signal.raise_signal(signal.SIGUSR1)\n"
        "    x = 1\n"
        "print('started' if drain.started else 'not started')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "started", out.stderr


def test_ctrl_c_saves_the_affixes_and_exits_without_a_traceback(tmp_path):
    """Ctrl-C (SIGINT) shuts down as SIGTERM does, affixes saved; uvicorn then raises the interrupt again, which
    the CLI reports as one line and exit status 130 instead of a KeyboardInterrupt traceback."""
    cache = tmp_path / "affixes"
    proc, port = start_server(["--affix-cache-dir", str(cache)])
    chat = {"messages": [{"role": "system", "content": "mary moved to the kitchen . john went to the garden ."},
                         {"role": "user", "content": "where is john?"}], "max_tokens": 2}
    try:
        for _ in range(2):  # seen twice: the check of the second computes the shared affix
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(chat),
                         headers={"Content-Type": "application/json"})
            assert conn.getresponse().status == 200
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    assert proc.returncode == 130 and "Traceback" not in out and out.rstrip().endswith("stopped"), out[-2000:]
    assert len(json.loads((cache / "manifest.json").read_text())["entries"]) == 1


@pytest.mark.parametrize("presses", [2, 3])
def test_a_second_ctrl_c_ends_the_grace_period_and_a_third_quits_both_saving(long_dir, tmp_path, presses):
    """The first Ctrl-C grants 60 s; the second ends them: the long request in flight gets its 503 at once and the
    server ends as usual. A third makes uvicorn quit without the app's own end (it logs the cancelled lifespan),
    and the CLI still saves the affix cache."""
    cache = tmp_path / "affixes"
    proc, port = start_server(["--model", str(long_dir), "--shutdown-grace", "60", "--affix-cache-dir", str(cache)])
    answer, elapsed = signalled_while_asked(proc, port, {"prompt": [4, 5], **LONG}, [signal.SIGINT] * presses)
    out = proc.stdout.read().decode()
    assert elapsed < 20 and "stopped" in out, out[-2000:]
    # a forced quit may be ended by the interrupts uvicorn raises again (status -2, and its log of the lifespan)
    assert (proc.returncode, "Traceback" in out) == (130, False) if presses == 2 else proc.returncode in (130, -2)
    assert answer["status"] == 503 and "told twice to stop" in answer["body"]["error"]["message"]
    assert (cache / "manifest.json").is_file()
