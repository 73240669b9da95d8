"""Where the engine keeps what it derives from the packaged weights (assembled models, ONNX graphs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: $STREAMSERVER_CACHE, else ~/.cache/streamserver.

    Everything under it can be deleted at any time; it is rebuilt on next use.
    """
    root = os.environ.get("STREAMSERVER_CACHE") or Path.home() / ".cache" / "streamserver"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
