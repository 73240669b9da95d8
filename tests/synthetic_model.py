"""A Whisper model folder with large-v3-turbo's geometry choices and random weights, written in
CTranslate2's format (model.bin version 6, config.json, tokenizer.json, vocabulary.txt): 128 mel
bins, a 51,866-token vocabulary with v3's special tokens (<|yue|> at 50358, every later special
one up), 4 decoder layers. Widths are small so that tests run in seconds; the variable names,
dtypes and aliases are those of the packaged base model's file, the shapes scaled to them.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from engines.weights import _DTYPES, _Reader, ct2_model_dir

YUE_ID = 50358  # v3 adds Cantonese after the 99 languages of v1/v2
BASE = {"width": 512, "mels": 80, "vocab": 51865}


SIDECARS = ("config.json", "tokenizer.json", "vocabulary.txt")


def export_template(out: Path) -> Path:
    """base's variable list (names, shapes, dtypes, the scalars' values, aliases) and its sidecar
    files, small enough to carry to a machine that lacks the base package (the GPU benchmark)."""
    variables, aliases = _template()
    out.mkdir(parents=True, exist_ok=True)
    spec = {"variables": [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype), **({"value": a.item()} if a.ndim == 0 else {})}
                          for n, a in variables], "aliases": aliases}
    (out / "template.json").write_text(json.dumps(spec))
    for name in SIDECARS:
        (out / name).write_bytes((ct2_model_dir("base") / name).read_bytes())
    return out


def _template(exported: Path | None = None) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str]]]:
    """base's variables in file order (name, array) and its aliases (from an exported template:
    placeholder arrays of the right shape and dtype, the scalars' values)."""
    if exported is not None:
        spec = json.loads((exported / "template.json").read_text())
        variables = [(v["name"], np.array(v["value"], v["dtype"]) if "value" in v else
                      np.broadcast_to(np.zeros((), v["dtype"]), v["shape"])) for v in spec["variables"]]
        return variables, [tuple(a) for a in spec["aliases"]]
    return read_model_bin(ct2_model_dir("base") / "model.bin")


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_model_bin(path: Path, variables: list[tuple[str, np.ndarray]], aliases: list[tuple[str, str]]) -> None:
    dtype_ids = {np.dtype(v): k for k, v in _DTYPES.items()}
    out = [struct.pack("<I", 6), _string("WhisperSpec"), struct.pack("<I", 3), struct.pack("<I", len(variables))]
    for name, array in variables:
        array = np.array(array, order="C", copy=True)  # (ascontiguousarray would make a scalar 1-D)
        out += [_string(name), struct.pack("<B", array.ndim), struct.pack(f"<{array.ndim}I", *array.shape),
                struct.pack("<BI", dtype_ids[array.dtype], array.nbytes), array.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases:
        out += [_string(alias), _string(target)]
    path.write_bytes(b"".join(out))


# large-v3-turbo itself: width 1280, 20 heads, 32 encoder layers, 4 decoder layers
TURBO = {"width": 1280, "heads": 20, "encoder_layers": 32, "decoder_layers": 4}


def write_turbo_like(folder: Path, width: int = 256, heads: int = 4, encoder_layers: int = 2, decoder_layers: int = 4,
                     seed: int = 0, dtype: type = np.float16, template: Path | None = None) -> Path:
    """The folder, with random weights (normal, std 0.02 for matrices; layer norms near 1).
    `template`: an export_template() folder instead of the installed base package."""
    rng = np.random.default_rng(seed)
    variables, aliases = _template(template)
    scale = {BASE["width"]: width, 2 * BASE["width"]: 2 * width, 3 * BASE["width"]: 3 * width, 4 * BASE["width"]: 4 * width,
             BASE["vocab"]: BASE["vocab"] + 1}
    layers = {"encoder": encoder_layers, "decoder": decoder_layers}
    out: list[tuple[str, np.ndarray]] = []
    for name, array in variables:
        m = re.match(r"(encoder|decoder)/layer_(\d+)/(.*)", name)
        if m and int(m.group(2)) > 0:
            continue  # layer 0 is the template of every layer
        names = [f"{m.group(1)}/layer_{i}/{m.group(3)}" for i in range(layers[m.group(1)])] if m else [name]
        for new_name in names:
            if array.ndim == 0:
                value = array.copy()
                if new_name.endswith("num_heads"):
                    value = np.array(heads, array.dtype)
                out.append((new_name, value))
                continue
            shape = [scale.get(n, n) for n in array.shape]
            if new_name.endswith("position_encodings/encodings"):
                shape = [array.shape[0], width]
            if new_name == "encoder/conv1/weight":
                shape[1] = 128
            if new_name.endswith("position_encodings/encodings"):
                out.append((new_name, _sinusoids(array.shape[0], width).astype(dtype)))
                continue
            std, mean = (0.1, 1.0) if new_name.endswith("gamma") else (0.02 * (5.0 if "embeddings" in new_name else 1.0), 0.0)
            values = rng.standard_normal(shape, dtype=np.float32) * std + mean
            out.append((new_name, values.astype(array.dtype if array.dtype != np.float16 else dtype)))
    folder.mkdir(parents=True, exist_ok=True)
    write_model_bin(folder / "model.bin", out, [(a, t) for a, t in aliases if not re.match(r".*/layer_[1-9]", a + t)])
    _write_sidecars(folder, template)
    return folder


def _sinusoids(length: int, channels: int) -> np.ndarray:
    log_timescale = np.log(10000) / (channels // 2 - 1)
    scaled = np.arange(length)[:, None] * np.exp(-log_timescale * np.arange(channels // 2))[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)


def _shift(token_id: int) -> int:
    return token_id + 1 if token_id >= YUE_ID else token_id


def _write_sidecars(folder: Path, template: Path | None = None) -> None:
    base = template or ct2_model_dir("base")
    config = json.loads((base / "config.json").read_text())
    config["lang_ids"] = sorted([*config["lang_ids"], YUE_ID])
    config["suppress_ids"] = [_shift(i) for i in config["suppress_ids"]]
    config["suppress_ids_begin"] = [_shift(i) for i in config["suppress_ids_begin"]]
    config["alignment_heads"] = [[2, 0], [3, 1]]
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        token["id"] = _shift(token["id"])
    yue = {**tokenizer["added_tokens"][0], "id": YUE_ID, "content": "<|yue|>"}
    tokenizer["added_tokens"] = sorted([*tokenizer["added_tokens"], yue], key=lambda t: t["id"])
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    vocabulary = (base / "vocabulary.txt").read_text().split("\n")
    if vocabulary and vocabulary[-1] == "":
        vocabulary.pop()
    vocabulary.insert(YUE_ID, "<|yue|>")
    (folder / "vocabulary.txt").write_text("\n".join(vocabulary) + "\n")
    (folder / "preprocessor_config.json").write_text(json.dumps({"feature_size": 128, "sampling_rate": 16000, "hop_length": 160,
                                                                 "n_fft": 400, "chunk_length": 30}))


def read_model_bin(path: Path) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str]]]:
    """A model.bin's variables in file order and its aliases."""
    data = path.read_bytes()
    r = _Reader(data, path)
    r.take("<I"), r.string(), r.take("<I")
    (count,) = r.take("<I")
    variables = []
    for _ in range(count):
        name = r.string()
        (rank,) = r.take("<B")
        shape = r.take(f"<{rank}I") if rank else ()
        dtype_id, nbytes = r.take("<BI")
        dtype = _DTYPES[dtype_id]
        variables.append((name, np.frombuffer(data, dtype, nbytes // np.dtype(dtype).itemsize, r.pos).reshape(shape)))
        r.pos += nbytes
    (n_alias,) = r.take("<I")
    return variables, [(r.string(), r.string()) for _ in range(n_alias)]


def quantize_int8(source: Path, target: Path) -> Path:
    """A copy of a model folder with its linear layers' weights in CTranslate2's int8 form (what
    `ct2-transformers-converter --quantization int8` writes): per output row a scale
    127 / max|w| stored as `<name>_scale`, the weight rounded to int8 after multiplying by it."""
    variables, aliases = read_model_bin(source / "model.bin")
    out: list[tuple[str, np.ndarray]] = []
    for name, array in variables:
        if re.search(r"linear_\d+/weight$", name):
            w = array.astype(np.float32)
            scale = (127.0 / np.maximum(np.abs(w).max(axis=1), 1e-8)).astype(np.float32)
            out += [(name, np.clip(np.round(w * scale[:, None]), -127, 127).astype(np.int8)), (name + "_scale", scale)]
        else:
            out.append((name, array))
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "model.bin":
            (target / f.name).write_bytes(f.read_bytes())
    write_model_bin(target / "model.bin", out, aliases)
    return target
