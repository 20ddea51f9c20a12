"""Where specdec keeps what it makes once per machine: converted models, llama.cpp's build, matmul plans."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "SPECDEC_CACHE_DIR"


def cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR`` or the user cache dir."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("specdec"))


@contextmanager
def publishing(target: Path, marker: str) -> Iterator[Path]:
    """A staging directory beside ``target``; what the block writes there becomes ``target`` in one
    rename, so a concurrent writer either wins or finds ``target / marker`` done (then its copy goes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        try:
            staging.rename(target)
        except OSError:
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
