"""Where specdec keeps what it makes once per machine: converted models, llama.cpp's build, matmul plans."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECDEC_CACHE_DIR"


def cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR`` or the user cache dir."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("specdec"))
