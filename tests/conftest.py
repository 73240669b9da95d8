"""Shared fixtures: real packaged weights, real LibriVox speech (tests/data/README.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# the `redis_url` fixture (a real redis-server); the needs_system marks (skip, or fail under CI)
pytest_plugins = ["tests.redis_server", "tests.system_packages"]

DATA = Path(__file__).parent / "data"
LIBRIVOX = sorted((DATA / "librivox").glob("*.wav"))


@pytest.fixture(scope="session")
def librivox() -> list[tuple[str, np.ndarray, str]]:
    """(name, 16 kHz audio, reference text) for each LibriVox clip."""
    from engines.audio import load_audio

    return [(p.stem, load_audio(p), p.with_suffix(".txt").read_text().strip()) for p in LIBRIVOX]


@pytest.fixture(scope="session")
def tiny_engine():
    from engines.loading import load_engine

    return load_engine("tiny.en", threads=2)


@pytest.fixture(scope="session")
def base_engine():
    from engines.loading import load_engine

    return load_engine("base", threads=2)
