"""Where the project keeps what it ships."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The small diffusion LM the project trains and ships: the default of the CLI and the server.
SHIPPED_MODEL = REPO_ROOT / "models" / "acache-tiny"


def default_model() -> Path:
    """The shipped model, or a clear error when this checkout has none."""
    if not (SHIPPED_MODEL / "config.json").is_file():
        raise FileNotFoundError(f"no --model given and no shipped model at {SHIPPED_MODEL}; pass --model PATH "
                                "(`acache make-random-checkpoint` writes one for trying things out)")
    return SHIPPED_MODEL
