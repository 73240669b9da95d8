"""What models this machine has: the packaged ones and the CTranslate2 folders under
$STREAMSERVER_MODEL_DIRS, each with its size, shape and languages (`streamserver models`).

The shape is read from model.bin's variable headers only (no weights are loaded), the languages
from config.json's lang_ids and tokenizer.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer

from engines.weights import MODELS, WeightsError, count_layers, ct2_model_dir, folders_in, model_dirs, read_ct2


@dataclass
class ModelInfo:
    name: str  # what --model takes
    source: str  # "packaged" or the folder's path
    size_mb: float
    n_mels: int | None
    width: int | None  # d_model
    encoder_layers: int | None
    decoder_layers: int | None
    vocabulary: int | None
    languages: list[str]
    error: str | None = None  # the folder could not be read


def _describe(name: str, source: str, folder: Path) -> ModelInfo:
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6
    try:
        tensors = read_ct2(folder / "model.bin")
        config = json.loads((folder / "config.json").read_text())
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as error:  # noqa: BLE001 - any unreadable folder is listed as such
        return ModelInfo(name, source, round(size, 1), None, None, None, None, None, [], f"{type(error).__name__}: {error}")
    conv1 = tensors["encoder/conv1/weight"]
    vocabulary = tensors["decoder/embeddings/weight"].shape[0]
    languages = [tokenizer.id_to_token(i).strip("<|>") for i in config.get("lang_ids", [])] if vocabulary >= 51865 else ["en"]
    return ModelInfo(name, source, round(size, 1), int(conv1.shape[1]), int(conv1.shape[0]), count_layers(tensors, "encoder"),
                     count_layers(tensors, "decoder"), int(vocabulary), languages)


def list_models() -> list[ModelInfo]:
    out = []
    for name in MODELS:
        try:
            out.append(_describe(name, "packaged", ct2_model_dir(name)))
        except WeightsError as error:
            out.append(ModelInfo(name, "packaged", 0.0, None, None, None, None, None, [], str(error)))
    for root in model_dirs():
        out += [_describe(folder.name, str(folder), folder) for folder in folders_in(root)]
    return out


def describe_models(json_lines: bool = False) -> list[str]:
    """One line per model: JSON objects, or a table for people."""
    models = list_models()
    if json_lines:
        return [json.dumps(asdict(m), ensure_ascii=False) for m in models]
    lines = [f"{'name':<22} {'size MB':>8} {'mels':>4} {'width':>5} {'enc':>3} {'dec':>3} {'vocab':>6}  languages  (source)"]
    for m in models:
        if m.error:
            lines.append(f"{m.name:<22} {m.size_mb:>8.1f}  cannot be read: {m.error}  ({m.source})")
            continue
        langs = ", ".join(m.languages[:8]) + (f" +{len(m.languages) - 8} more" if len(m.languages) > 8 else "")
        lines.append(f"{m.name:<22} {m.size_mb:>8.1f} {m.n_mels:>4} {m.width:>5} {m.encoder_layers:>3} {m.decoder_layers:>3} "
                     f"{m.vocabulary:>6}  {langs}  ({m.source})")
    if not model_dirs():
        lines.append("(no STREAMSERVER_MODEL_DIRS set: only the packaged models)")
    return lines
