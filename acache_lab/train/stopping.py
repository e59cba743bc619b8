"""How a long run is stopped and still saved: a first Ctrl-C, or a SIGTERM (``timeout``, a batch scheduler), asks it
to stop after its step; a second Ctrl-C quits at once; once it is saving, Ctrl-C only says to wait. The one rule of
``acache train`` and ``acache finetune-affix``."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def stop_requests(say: Callable[[str], None], on_ctrl_c: str, while_saving: str) -> Iterator[dict]:
    """A run's stop flag: ``["asked"]`` becomes what asked (``"Ctrl-C"`` or ``"SIGTERM"``, the first of them) for
    the loop to stop at its next step; the caller sets ``["saving"]`` once its files are being written, after which
    Ctrl-C only says ``while_saving``. The handlers before are put back after; only in the main thread, where Python
    delivers signals."""
    stop: dict = {"asked": None, "saving": False}
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_sigint(signum, frame) -> None:
        if stop["saving"]:
            say(while_saving)
            return
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = "Ctrl-C"
        say(on_ctrl_c)

    def on_sigterm(signum, frame) -> None:
        stop["asked"] = stop["asked"] or "SIGTERM"

    before = signal.signal(signal.SIGINT, on_sigint), signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
