"""Starting a real ``acache serve`` process for the server tests, and waiting on its metrics."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """``acache serve ARGS`` on a free port, once /health answers 200; the output names why if it does not."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "acache.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())
    raise RuntimeError(f"server did not start in 120 s; its output:\n{stop_server(proc)[1][-4000:]}")


def stop_server(proc: subprocess.Popen, seconds: float = 120) -> tuple[int | None, str]:
    """SIGTERM, as a user stops a server, and its exit code and output; a server still up ``seconds`` later is
    killed (None), so a test fails with the output rather than hangs."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    return code, proc.stdout.read().decode(errors="replace")


def wait_until(condition: Callable[[], bool], seconds: float, poll: float = 0.1) -> bool:
    """True as soon as `condition` holds once; the condition is not asked again, as a second reading may differ."""
    deadline = time.time() + seconds
    while not condition():
        if time.time() >= deadline:
            return False
        time.sleep(poll)
    return True
