"""Which GPU, TensorRT and weights a serialized engine belongs to, and where it is cached.

A TensorRT plan holds kernels chosen for one GPU kind and one TensorRT version; loaded anywhere
else it is refused, or worse, runs slowly. So the cache key covers everything a plan depends
on, and a sidecar .json next to the plans repeats it in the clear: before a plan is loaded the
sidecar is compared with this machine, and any difference means "rebuild", never "try it".

Files, under cache_dir()/tensorrt/:  {model}-{key[:16]}.encoder.plan, .decoder.plan, .json
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from engines.cache import cache_dir

GRAPHS = ("encoder", "decoder")
# Fields that describe this machine rather than the model: a cached engine whose sidecar differs
# in one of them was built elsewhere, which is worth saying when it is not reused.
MACHINE_FIELDS = ("gpu_name", "compute_capability", "trt_module", "trt_version")


@dataclass(frozen=True)
class EngineIdentity:
    model: str
    weights_sha256: str
    graph_version: int  # engines.graphs.GRAPH_VERSION
    graph_flavour: str  # "portable"
    trt_module: str  # "tensorrt" or "tensorrt_rtx_bindings": their plans are not interchangeable
    trt_version: str
    gpu_name: str
    compute_capability: str  # "9.0"
    precision: str  # fp16, int8, fp32
    calibration_digest: str | None  # int8 only: digest_files() of the calibration audio
    profiles: dict  # {"encoder": [Profile.as_json()], "decoder": [...]}

    def as_json(self) -> dict:
        return asdict(self)

    def key(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no spaces): equal identities, equal keys."""
        canonical = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def digest_files(paths: Iterable[Path]) -> str:
    """sha256 over the names and contents of the calibration files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def engines_dir() -> Path:
    path = cache_dir() / "tensorrt"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class EngineFiles:
    sidecar: Path
    plans: dict[str, Path]  # "encoder" / "decoder" -> .plan


def engine_files(identity: EngineIdentity, folder: Path | None = None) -> EngineFiles:
    stem = f"{identity.model}-{identity.key()[:16]}"
    folder = folder or engines_dir()
    return EngineFiles(folder / f"{stem}.json", {g: folder / f"{stem}.{g}.plan" for g in GRAPHS})


def write_sidecar(identity: EngineIdentity, files: EngineFiles) -> None:
    """Written last, after both plans: a sidecar means a complete, usable pair."""
    record = {"key": identity.key(), "identity": identity.as_json(),
              "plan_bytes": {g: p.stat().st_size for g, p in files.plans.items()}}
    tmp = files.sidecar.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(files.sidecar)


def mismatches(recorded: dict, wanted: EngineIdentity, ignore: tuple[str, ...] = ()) -> list[str]:
    """Fields where a sidecar's identity differs from the wanted one, as 'field: was -> now'."""
    now = wanted.as_json()
    return [
        f"{field}: {recorded.get(field)!r} -> {now[field]!r}"
        for field in now
        if field not in ignore and recorded.get(field) != now[field]
    ]


def _read(sidecar: Path) -> dict | None:
    try:
        return json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None  # half-written or foreign: treat as absent


def _complete(record: dict, files: EngineFiles) -> bool:
    sizes = record.get("plan_bytes", {})
    return all(p.exists() and p.stat().st_size == sizes.get(g) for g, p in files.plans.items())


def find_cached(wanted: EngineIdentity, any_calibration: bool = False) -> tuple[EngineFiles | None, list[str]]:
    """Cached engines for `wanted` on this machine, or None and why the near misses were refused.

    any_calibration: an int8 engine of any calibration set will do (the runtime does not know
    which audio the user calibrated with; `streamserver engine build` does).
    """
    ignore = ("calibration_digest",) if any_calibration else ()
    refused = []
    for sidecar in sorted(engines_dir().glob(f"{wanted.model}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        record = _read(sidecar)
        if record is None or not isinstance(record.get("identity"), dict):
            continue
        recorded = record["identity"]
        stem = sidecar.name.removesuffix(".json")
        files = EngineFiles(sidecar, {g: sidecar.with_name(f"{stem}.{g}.plan") for g in GRAPHS})
        diff = mismatches(recorded, wanted, ignore)
        if not diff and record.get("key", "")[:16] == stem.rsplit("-", 1)[-1] and _complete(record, files):
            return files, []
        if any(d.split(":")[0] in MACHINE_FIELDS for d in diff) and not mismatches(recorded, wanted, ignore + MACHINE_FIELDS):
            refused.append(f"{sidecar.name} was built for another GPU or TensorRT ({'; '.join(diff)})")
    return None, refused
