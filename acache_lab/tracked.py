"""Where the research commands write: never over a file git tracks unless the caller says ``--overwrite``.

The shipped plots, tables and model live in the repository; a benchmark or study pointed at them by
mistake would silently replace the published figures with a run from another machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path


def tracked_files(path: str | Path) -> list[str]:
    """The files git tracks at ``path`` (a file, or everything under a directory); none outside a repository."""
    path = Path(path).absolute()
    anchor = path if path.is_dir() else path.parent
    while not anchor.exists():
        anchor = anchor.parent
    try:
        done = subprocess.run(["git", "ls-files", "-z", "--", str(path)], cwd=anchor, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git: nothing can be known to be tracked
        return []
    return [name for name in done.stdout.split("\0") if name] if done.returncode == 0 else []


def refuse_tracked(paths: Iterable[str | Path | None], overwrite: bool) -> None:
    """Raises a ValueError naming the tracked files ``paths`` would overwrite, unless ``overwrite``."""
    if overwrite:
        return
    for path in paths:
        if path is None:
            continue
        tracked = tracked_files(path)
        if tracked:
            shown = ", ".join(tracked[:3]) + (f" and {len(tracked) - 3} more" if len(tracked) > 3 else "")
            raise ValueError(f"{path} would overwrite files tracked by git ({shown}); write elsewhere (build/ is "
                             "ignored) or pass --overwrite")


def refuse_full_dir(out: str | Path, overwrite: bool) -> None:
    """Raises when ``out`` cannot take a checkpoint of its own: a file, or a directory holding files (unless
    ``overwrite``, whose caller then clears it), since a checkpoint written among old files can load as the old one
    (a stale shard index wins over a new single file)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a directory for the checkpoint")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
