"""What an install gets (issue 32): every third-party module the package imports (streamserver/
and engines/, lazy imports included) is declared in pyproject.toml, and constraints.txt pins
every distribution an install of the project and its extras takes, within the declared ranges;
`make install` (and so CI, whose .ci/run is `make test`) and both Dockerfiles install through
it. tests/test_install.py installs the package through it into a fresh venv."""

from __future__ import annotations

import ast
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools.constraints import closure, declared

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"streamserver", "engines", "tests", "benchmarks", "tools"}


def imported_modules(folders: list[Path]) -> dict[str, str]:
    """Each top-level third-party module imported anywhere in `folders`, and one file importing it."""
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        found.setdefault(top, str(path.relative_to(folder.parent)))
    return found


def undeclared(modules: dict[str, str]) -> list[str]:
    """The modules no declared distribution provides: by the installed distributions' own lists
    of modules, or by name for one not installed here (torch of the gpu extra)."""
    names = {canonicalize_name(r.name) for reqs in declared().values() for r in reqs}
    providers = md.packages_distributions()
    return [f"{module} (imported by {where})" for module, where in sorted(modules.items())
            if not ({canonicalize_name(d) for d in providers.get(module, [])} | {canonicalize_name(module)}) & names]


def test_every_module_the_package_imports_is_declared():
    modules = imported_modules([ROOT / "streamserver", ROOT / "engines"])
    assert {"aiohttp", "numpy", "cryptography", "pylibsrtp", "ifaddr", "torch"} <= modules.keys()  # lazy ones too
    assert undeclared(modules) == []


def test_the_check_finds_a_module_that_is_not_declared(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("import json\nimport yaml\nfrom streamserver import client\n\n"
                                  "def later():\n    from jsonschema import validate\n")
    modules = imported_modules([package])
    assert modules.keys() == {"yaml", "jsonschema"}  # stdlib and first party are not counted
    assert undeclared(modules) == ["jsonschema (imported by pkg/m.py)", "yaml (imported by pkg/m.py)"]  # installed, not declared


def test_constraints_pin_every_distribution_an_install_takes_within_the_declared_ranges():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line  # exact, not a range
            pins[canonicalize_name(requirement.name)] = spec.version
    roots = [r for reqs in declared().values() for r in reqs]
    installed, missing = closure(roots)
    assert missing <= {"torch", "pycuda"}  # the GPU extras, not installed where the tests run
    assert installed.keys() == pins.keys(), "constraints.txt is out of date: `make constraints`"
    for requirement in roots:
        name = canonicalize_name(requirement.name)
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), (str(requirement), pins[name])


def test_make_ci_and_the_images_install_through_the_constraints(tmp_path):
    # What `make install` runs, for a venv that is not there yet (-n: printed, not run).
    planned = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    installs = [line for line in planned.splitlines() if "pip install" in line and "-e" in line.split()]
    assert installs and all("-c constraints.txt" in line for line in installs), planned
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert any(line.startswith("test: install") for line in (ROOT / "Makefile").read_text().splitlines())
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        text = (ROOT / "docker" / dockerfile).read_text()
        assert "COPY constraints.txt /tmp/constraints.txt" in text
        pips = [line for line in text.splitlines() if line.strip().startswith("pip install")]
        assert len(pips) == 2 and all("-c /tmp/constraints.txt" in line for line in pips), (dockerfile, pips)
    assert "!constraints.txt" in (ROOT / ".dockerignore").read_text().splitlines()  # in the build context
    assert "constraints.txt" in (ROOT / "docker" / "build-image.sh").read_text()  # a new pin is a new image
