"""The TensorRT engine cache key and sidecar checks: pure logic, run without TensorRT or a GPU."""

import json
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from engines.graphs import GRAPH_VERSION
from engines.tensorrt import Gpu
from engines.tensorrt.builder import identity_for
from engines.tensorrt.cache_key import EngineIdentity, digest_files, engine_files, find_cached, write_sidecar
from engines.tensorrt.profiles import engine_profiles
from tests.test_tensorrt_profiles import BASE

# A value that differs from IDENTITY's, for every field.
OTHER = {
    "model": "tiny.en", "weights_sha256": "1a5a" * 16, "graph_version": GRAPH_VERSION + 1, "graph_flavour": "fp32",
    "trt_module": "tensorrt_rtx_bindings", "trt_version": "10.14.1.48", "gpu_name": "NVIDIA A100-SXM4-80GB",
    "compute_capability": "8.0", "precision": "int8", "calibration_digest": "ab" * 32,
    "profiles": {"encoder": [], "decoder": []},
}


@pytest.fixture
def identity() -> EngineIdentity:
    trt = SimpleNamespace(__name__="tensorrt", __version__="10.13.3.9")
    weights = SimpleNamespace(name="base", sha256="d01c" * 16)
    return identity_for(trt, Gpu("NVIDIA H200", "9.0"), weights, "fp16", engine_profiles(BASE, "base"))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STREAMSERVER_CACHE", str(tmp_path))
    return tmp_path / "tensorrt"


def _cached(identity: EngineIdentity) -> None:
    files = engine_files(identity)
    for graph, path in files.plans.items():
        path.write_bytes(graph.encode() * 100)
    write_sidecar(identity, files)


def test_identical_inputs_give_identical_keys(identity: EngineIdentity):
    again = EngineIdentity(**json.loads(json.dumps(identity.as_json())))  # through JSON, as a sidecar holds it
    assert again.key() == identity.key() and len(identity.key()) == 64
    reordered = replace(identity, profiles=dict(reversed(list(identity.profiles.items()))))
    assert reordered.key() == identity.key()  # canonical JSON: key order does not matter


def test_every_field_changes_the_key(identity: EngineIdentity):
    assert set(OTHER) == {f.name for f in fields(EngineIdentity)}
    keys = {identity.key()} | {replace(identity, **{name: value}).key() for name, value in OTHER.items()}
    assert len(keys) == len(OTHER) + 1
    one_shape = json.loads(json.dumps(identity.profiles))
    one_shape["encoder"][0]["shapes"]["mel"][2][0] = 32  # max batch 64 -> 32
    assert replace(identity, profiles=one_shape).key() != identity.key()


def test_identity_records_graph_version_and_the_trt_module(identity: EngineIdentity):
    assert identity.graph_version == GRAPH_VERSION and identity.graph_flavour == "portable"
    assert (identity.trt_module, identity.trt_version, identity.compute_capability) == ("tensorrt", "10.13.3.9", "9.0")


def test_calibration_digest_follows_names_and_contents(tmp_path: Path):
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    a.write_bytes(b"one")
    b.write_bytes(b"two")
    first = digest_files([a, b])
    assert digest_files([b, a]) == first  # order given does not matter
    b.write_bytes(b"three")
    changed = digest_files([a, b])
    assert changed != first
    renamed = b.rename(tmp_path / "c.wav")
    assert digest_files([a, renamed]) != changed


def test_cached_engines_are_found_with_their_sidecar(identity: EngineIdentity, cache: Path):
    assert find_cached(identity) == (None, [])
    _cached(identity)
    files, refused = find_cached(identity)
    assert files == engine_files(identity) and not refused
    sidecar = json.loads(files.sidecar.read_text())
    assert sidecar["key"] == identity.key() and sidecar["identity"]["gpu_name"] == "NVIDIA H200"
    assert files.sidecar.name == f"base-{identity.key()[:16]}.json"


@pytest.mark.parametrize("field", ["gpu_name", "compute_capability", "trt_version", "trt_module"])
def test_an_engine_of_another_gpu_or_tensorrt_is_refused_with_the_reason(identity: EngineIdentity, cache: Path, field: str):
    _cached(replace(identity, **{field: OTHER[field]}))
    files, refused = find_cached(identity)
    assert files is None
    assert len(refused) == 1 and field in refused[0] and repr(OTHER[field]) in refused[0]


def test_a_tampered_sidecar_or_a_truncated_plan_means_rebuild(identity: EngineIdentity, cache: Path):
    _cached(identity)
    files = engine_files(identity)
    record = json.loads(files.sidecar.read_text())
    record["identity"]["compute_capability"] = "8.9"  # copied from another machine and edited
    files.sidecar.write_text(json.dumps(record))
    assert find_cached(identity)[0] is None
    _cached(identity)
    files.plans["decoder"].write_bytes(b"half")
    assert find_cached(identity)[0] is None
    files.sidecar.write_text("{not json")
    assert find_cached(identity) == (None, [])


def test_int8_engines_of_any_calibration_set_serve_the_runtime(identity: EngineIdentity, cache: Path):
    built = replace(identity, precision="int8", calibration_digest="cd" * 32)
    _cached(built)
    wanted = replace(identity, precision="int8", calibration_digest=None)
    assert find_cached(wanted)[0] is None  # the exact key differs ...
    files, _ = find_cached(wanted, any_calibration=True)
    assert files == engine_files(built)  # ... but any calibration will do for loading
    assert find_cached(replace(wanted, gpu_name="NVIDIA L4"), any_calibration=True)[0] is None
