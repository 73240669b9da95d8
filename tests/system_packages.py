"""Tests that need a system package (Chromium, coturn, a TLS-capable redis-server, podman or
Docker, iptables): where it is missing they skip and say why, and under CI (CI=true) they fail
instead, naming the package: CI's `make test` installs them all, so one missing there is a broken
setup, and a skip would hide that the test never ran.

Only a missing package: a test that cannot run for another reason (no GPU, not root) skips
everywhere. Wired into tests/conftest.py with `pytest_plugins`, which runs the `needs_system`
marks.
"""

from __future__ import annotations

import os

import pytest

MARK = "needs_system"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def require_system(package: str, missing: str | None) -> None:
    """Within a test or fixture: skip it, or fail it under CI, when `missing` says why `package`
    is not there (None: it is)."""
    if missing is None:
        return
    if in_ci():
        pytest.fail(f"system package {package} is missing, and CI=true fails for it rather than skip: {missing}",
                    pytrace=False)
    pytest.skip(f"system package {package} is missing: {missing}")


def needs_system(package: str, missing: str | None) -> pytest.MarkDecorator:
    """require_system as a mark, for a test or a module's `pytestmark`: checked before the test's
    fixtures are set up, as skipif is."""
    return getattr(pytest.mark, MARK)(package, missing)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(package, missing): the test needs a system package; "
                                       "`missing` says why it is not there (None: it is)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(MARK):
        require_system(*mark.args)
