"""Any Whisper model a school has (issue 16): a CTranslate2 (faster-whisper) model folder by
path, on the real packaged weights written out as a plain folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.audio import load_audio
from engines.cache import cache_dir
from engines.weights import WeightsError, ct2_model_dir, folder_digest, load_weights, resolve_model

DATA = Path(__file__).parent / "data"
ZH_DEV = Path("/work/shared/data/zh_dev")  # the project's Mandarin dev clips, where present


def dev_clips() -> list[Path]:
    return sorted([*DATA.glob("librivox/*.wav"), *DATA.glob("flite/*.wav"), *(ZH_DEV.glob("*.wav") if ZH_DEV.is_dir() else [])])


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> Path:
    """The packaged base weights as a plain model folder, as faster-whisper's are."""
    folder = tmp_path_factory.mktemp("models") / "whisper-base"
    shutil.copytree(ct2_model_dir("base"), folder, ignore=shutil.ignore_patterns("verified", "*.partial"))
    return folder


def test_a_folder_gives_the_same_text_as_the_packaged_model(base_folder, base_engine):
    """Every dev clip, language zh, through the folder and through `base`: the same text."""
    from engines.loading import load_engine

    folder_engine = load_engine(str(base_folder), threads=2)
    assert folder_engine.multilingual and folder_engine.model == str(base_folder)
    clips = dev_clips()
    audios = [load_audio(p) for p in clips]
    ours = [t.text for t in folder_engine.transcribe_batch(audios, "zh")]
    packaged = [t.text for t in base_engine.transcribe_batch(audios, "zh")]
    assert ours == packaged
    assert sum(bool(t) for t in ours) >= len(clips) // 2  # not a run of empty results (English in zh may be)


def test_the_cli_takes_a_folder(base_folder):
    """`streamserver transcribe --model DIR --language zh` on every dev clip: base's text."""
    clips = [str(p) for p in dev_clips()]
    run = lambda model: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "streamserver", "transcribe", "--model", model, "--language", "zh", "--json", *clips],
        capture_output=True, text=True, timeout=600)
    by_folder, by_name = run(str(base_folder)), run("base")
    assert by_folder.returncode == 0, by_folder.stderr[-2000:]
    texts = lambda r: {row["file"]: row["text"] for row in map(json.loads, r.stdout.splitlines())}  # noqa: E731
    assert texts(by_folder) == texts(by_name) and len(texts(by_folder)) == len(clips)
    bad = run(str(base_folder.parent / "nowhere"))
    assert bad.returncode == 2 and "is not a CTranslate2 Whisper model folder" in bad.stderr


def test_one_graph_cache_entry_per_folder_content(base_folder, tmp_path):
    """The same content under two paths shares one entry; a changed file gets a new digest."""
    from engines.graphs import graph_paths

    twin = tmp_path / "same-model-elsewhere"
    shutil.copytree(base_folder, twin)
    a, b = load_weights(str(base_folder)), load_weights(str(twin))
    assert a.sha256 == b.sha256 == folder_digest(twin)
    assert graph_paths(a)[0].parent == graph_paths(b)[0].parent
    entries = [p for p in (cache_dir() / "graphs").iterdir() if p.name.startswith(f"folder-{a.sha256[:16]}")]
    assert len(entries) == 1
    changed = tmp_path / "changed"
    shutil.copytree(base_folder, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "suppress_ids_begin": [220, 50257, 1]}))
    assert folder_digest(changed) != a.sha256


def test_clear_errors_for_what_is_not_a_model(tmp_path, monkeypatch):
    with pytest.raises(WeightsError, match="has no model.bin"):
        resolve_model(str(tmp_path))
    with pytest.raises(WeightsError, match="STREAMSERVER_MODEL_DIRS is unset"):
        monkeypatch.delenv("STREAMSERVER_MODEL_DIRS", raising=False)
        resolve_model("large-v3")
    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00" + b"\x00" * 8)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(WeightsError):
        load_weights(str(tmp_path))


def test_models_lists_folders_of_model_dirs(base_folder, monkeypatch):
    monkeypatch.setenv("STREAMSERVER_MODEL_DIRS", str(base_folder.parent))
    assert resolve_model("whisper-base") == str(base_folder.resolve())
    run = subprocess.run([sys.executable, "-m", "streamserver", "models", "--json"], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "STREAMSERVER_MODEL_DIRS": str(base_folder.parent)})
    assert run.returncode == 0, run.stderr
    rows = {r["name"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert {"tiny.en", "base", "whisper-base"} <= rows.keys()
    folder = rows["whisper-base"]
    assert (folder["n_mels"], folder["width"], folder["encoder_layers"], folder["decoder_layers"], folder["vocabulary"]) == (80, 512, 6, 6, 51865)
    assert "zh" in folder["languages"] and rows["tiny.en"]["languages"] == ["en"]
    assert np.isclose(folder["size_mb"], rows["base"]["size_mb"], rtol=0.01)


# --- large-v3-turbo geometry: 128 mels, 51,866 tokens, v3's special tokens, 4 decoder layers --------

@pytest.fixture(scope="module")
def turbo_like(tmp_path_factory) -> Path:
    from tests.synthetic_model import write_turbo_like

    return write_turbo_like(tmp_path_factory.mktemp("turbo") / "turbo-like")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _turbo_checks(engine, folder: Path, encode, logits_of) -> None:  # noqa: ANN001 - an Engine and two callables
    """Against ctranslate2 on the same folder (the reference faster-whisper runs on): encoder
    output (through its cross-attention projections), the logits after a forced prefix, and
    greedy tokens on five clips."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from engines.features import log_mel
    from tests import reference_whisper as ref

    weights = load_weights(str(folder))
    assert (weights.dims.n_mels, weights.dims.n_vocab, weights.dims.n_text_layer) == (128, 51866, 4)
    tok = engine.tokenizer
    assert tok.special("<|yue|>") == 50358 and tok.special("<|transcribe|>") == 50360 and "yue" in tok.languages
    t64 = ref.as_float64(weights.tensors)
    ct2 = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32")
    clips = [load_audio(p) for p in sorted(DATA.glob("librivox/*.wav"))][:4] + [load_audio(DATA / "flite" / "flite_1.wav")]
    mels = [log_mel(c[: 16000 * 29], 3000, None, 128)[None] for c in clips]
    prefix = [tok.sot, tok.languages["en"], tok.special("<|transcribe|>"), tok.special("<|notimestamps|>")]

    # encoder: ctranslate2's output; ours as the cross-attention K/V it feeds (the graph's output)
    features = np.array(ct2.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(mels[0])), to_cpu=True))
    for i, (k, v) in enumerate(ref.cross_kv(t64, weights.dims, features.astype(np.float64))):
        ours_k, ours_v = encode(mels[0], i)
        assert _rel(ours_k, k) < 1e-3 and _rel(ours_v, v) < 1e-3

    # logits after the forced prefix: ctranslate2 gives them for the tokens it generates
    result = ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(mels[0])), [prefix], beam_size=1,
                          max_length=len(prefix) + 1, return_logits_vocab=True, suppress_blank=False,
                          suppress_tokens=[tok.eot])  # end-of-text masked: a random model may say it first
    theirs = np.array(result[0].logits[0][0])
    ours = logits_of(mels[0], prefix)
    keep = np.arange(ours.size) != tok.eot
    assert _rel(ours[keep], theirs[keep]) < 1e-3

    # greedy tokens, the same suppression both ways (the config's ids, every special token; no
    # blank or end-of-text first)
    suppress = sorted(set(tok.suppress_ids) | set(range(tok.eot + 1, weights.dims.n_vocab)))
    budget = 24
    same = 0
    for mel in mels:
        generated = ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(mel)), [prefix], beam_size=1,
                                 max_length=len(prefix) + budget, suppress_blank=True, suppress_tokens=suppress)
        theirs_tokens = generated[0].sequences_ids[0]
        ours_tokens = engine_greedy(engine, mel, budget)
        same += ours_tokens[: len(theirs_tokens)] == theirs_tokens
    assert same >= 4, same

    # the whole engine on it: shapes, token rules and the no-speech gate hold (random text or none)
    results = engine.transcribe_batch(clips, "en")
    assert len(results) == len(clips) and all(isinstance(r.text, str) for r in results)
    assert engine.transcribe_batch([np.zeros(16000, np.float32)], "en")[0].text == ""  # silence: no words


def engine_greedy(engine, mel: np.ndarray, budget: int) -> list[int]:  # noqa: ANN001 - an Engine
    from engines.decoding import greedy_decode

    state = engine.backend.encode(mel)
    return greedy_decode(engine.backend, state, engine.tokenizer, ["en"], [budget])[0].tokens


@pytest.mark.parametrize("stored", ["float16", "int8"])
def test_turbo_geometry_on_onnxruntime_matches_ctranslate2(turbo_like, stored, tmp_path):
    """Weights stored as float16, and as CTranslate2's int8 (turned back into float32 here, by
    ctranslate2 itself when it computes in float32): the same results both ways."""
    from engines.loading import load_engine
    from tests.synthetic_model import quantize_int8

    folder = turbo_like if stored == "float16" else quantize_int8(turbo_like, tmp_path / "turbo-int8")
    engine = load_engine(str(folder), threads=2, precision="fp32")

    def encode(mel: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
        state = engine.backend.encode(mel)
        return state.cross_kv[f"cross_k_{layer}"], state.cross_kv[f"cross_v_{layer}"]

    def logits_of(mel: np.ndarray, prefix: list[int]) -> np.ndarray:
        logits, _ = engine.backend.step(np.array([prefix]), engine.backend.encode(mel))
        return logits[0]

    _turbo_checks(engine, folder, encode, logits_of)



def torch_cpu_agreement(folder: Path, clips: list[np.ndarray], budget: int = 16) -> dict[str, float]:
    """The torch engine's model (engines/gpu/model.py, on the CPU in float32) against the plain
    numpy reference (tests/reference_whisper.py, float64) on a model folder: the largest relative
    difference of the cross-attention K/V and of the logits after the forced prefix, and on how
    many clips greedy decoding (the engine's suppression rules, both ways) gives the same tokens.
    The reference is itself checked against ctranslate2 here (test_turbo_geometry_...), so this
    is the torch side of the same comparison; it runs wherever torch is installed."""
    import torch

    from engines.decoding import _suppression
    from engines.features import log_mel
    from engines.gpu.model import TorchWhisper
    from engines.tokenizer import WhisperTokenizer
    from tests import reference_whisper as ref

    weights = load_weights(str(folder))
    tok = WhisperTokenizer.load(weights.folder, weights.config, weights.dims.n_vocab)
    model = TorchWhisper(weights, torch.device("cpu"), torch.float32)
    t64 = ref.as_float64(weights.tensors)
    prefix = [tok.sot, tok.languages["en"], tok.special("<|transcribe|>"), tok.special("<|notimestamps|>")]
    always, first = _suppression(tok, weights.dims.n_vocab)
    figures = {"kv": 0.0, "logits": 0.0, "same_tokens": 0, "clips": len(clips)}
    for i, clip in enumerate(clips):
        mel = log_mel(clip[: 16000 * 29], 3000, None, weights.dims.n_mels)[None]
        with torch.inference_mode():
            kv = model.encode(torch.from_numpy(mel))
        features = ref.encode(t64, weights.dims, mel.astype(np.float64))
        if i == 0:
            for (k, v), (rk, rv) in zip(kv, ref.cross_kv(t64, weights.dims, features)):
                figures["kv"] = max(figures["kv"], _rel(k.numpy(), rk), _rel(v.numpy(), rv))
        ours: list[int] = []
        theirs: list[int] = []
        for tokens, logits_of in ((ours, lambda seq: model.prefill(torch.tensor([seq]), kv, len(seq) - 1)[1][0].numpy()),
                                  (theirs, lambda seq: ref.decoder_logits(t64, weights.dims, np.array([seq]), features)[0, -1])):
            for step in range(budget):
                logits = logits_of(prefix + tokens)
                if i == 0 and step == 0 and tokens is ours:
                    figures["logits"] = _rel(logits, ref.decoder_logits(t64, weights.dims, np.array([prefix]), features)[0, -1])
                chosen = int(np.where(first if step == 0 else always, -np.inf, logits).argmax())
                if chosen == tok.eot:
                    break
                tokens.append(chosen)
        figures["same_tokens"] += ours == theirs
    return figures


def test_turbo_geometry_on_torch_cpu_matches_the_reference(turbo_like):
    pytest.importorskip("torch", reason="torch (the gpu extra) is not installed here")
    clips = [load_audio(p) for p in sorted(DATA.glob("librivox/*.wav"))][:4] + [load_audio(DATA / "flite" / "flite_1.wav")]
    figures = torch_cpu_agreement(turbo_like, clips)
    assert figures["kv"] < 1e-3 and figures["logits"] < 1e-3 and figures["same_tokens"] >= 4, figures
