"""Compare our ONNX Runtime Whisper engine with faster-whisper on the same weights.

Both engines get the same CTranslate2 weights (engines.weights.ct2_model_dir),
the same 16 kHz audio (engines.audio.load_audio, decoded once before timing),
the same thread count and greedy decoding, so the latency ratio and the error
rates compare the engines rather than the set-up.  Models are loaded and
warmed up on the first clip before any timing; each timed region is one
transcription call, including consuming faster-whisper's lazy segment generator.

    .venv/bin/python -m benchmarks.compare_faster_whisper --model tiny.en --language en \\
        --clips /work/shared/data/en_dev --engines ours,fw-int8,fw-float32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file path: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.scoring import cer, has_traditional, wer  # noqa: E402

PROMPTS = {"en": None, "zh": "以下是普通话的句子。"}
ENGINES = ("ours", "fw-int8", "fw-float32")
DEFAULT_CLIPS = {"en": "tests/data/librivox"}

Transcriber = Callable[[np.ndarray], str]


@dataclass
class Clip:
    name: str
    audio: np.ndarray
    reference: str


def load_clips(folder: Path) -> list[Clip]:
    """Every NAME.wav with a NAME.txt beside it, decoded once up front."""
    from engines.audio import load_audio

    clips = [
        Clip(wav.stem, load_audio(wav), wav.with_suffix(".txt").read_text(encoding="utf-8").strip())
        for wav in sorted(folder.glob("*.wav"))
        if wav.with_suffix(".txt").exists()
    ]
    if not clips:
        raise SystemExit(f"no NAME.wav + NAME.txt pairs in {folder}")
    return clips


def make_ours(model: str, language: str, threads: int, policy: str | None = None) -> Transcriber:
    from engines.loading import load_engine

    engine = load_engine(model, threads=threads, policy=policy)
    prompt = PROMPTS[language]
    return lambda audio: engine.transcribe_batch([audio], language=language, prompt=prompt)[0].text.strip()


def make_faster_whisper(model: str, language: str, threads: int, compute_type: str) -> Transcriber:
    from faster_whisper import WhisperModel

    from engines.weights import ct2_model_dir

    fw = WhisperModel(
        str(ct2_model_dir(model)), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=1
    )

    def transcribe(audio: np.ndarray) -> str:
        segments, _info = fw.transcribe(
            audio,
            language=language,
            beam_size=1,
            best_of=1,
            temperature=0.0,
            without_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
            initial_prompt=PROMPTS[language],
        )
        return "".join(s.text for s in segments).strip()  # the generator does the decoding

    return transcribe


def make_engine(name: str, model: str, language: str, threads: int) -> Transcriber:
    if name == "ours" or name.startswith("ours-"):
        return make_ours(model, language, threads, name.removeprefix("ours-") if name != "ours" else None)
    return make_faster_whisper(model, language, threads, compute_type=name.removeprefix("fw-"))


def run_engine(name: str, transcribe: Transcriber, clips: list[Clip], repeat: int, language: str) -> dict:
    """Time every clip `repeat` times; score the text of the first run (decoding is greedy)."""
    transcribe(clips[0].audio)  # warm-up: first-call allocations are not per-utterance cost
    rows = []
    for i, clip in enumerate(clips, 1):
        times, texts = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            texts.append(transcribe(clip.audio))
            times.append((time.perf_counter() - start) * 1000)
        ms = statistics.median(times)
        rows.append({"name": clip.name, "reference": clip.reference, "hypothesis": texts[0],
                     "times_ms": [round(t, 1) for t in times], "median_ms": round(ms, 1),
                     "stable_text": len(set(texts)) == 1})
        print(f"[{name}] {i}/{len(clips)} {clip.name}: {ms:.0f} ms  {texts[0][:70]}", file=sys.stderr, flush=True)

    medians = [r["median_ms"] for r in rows]
    refs, hyps = [r["reference"] for r in rows], [r["hypothesis"] for r in rows]
    summary = {"median_ms": round(float(np.median(medians)), 1), "p90_ms": round(float(np.percentile(medians, 90)), 1)}
    if language == "zh":
        summary["cer"] = round(cer(refs, hyps), 4)
        summary["traditional_outputs"] = sum(has_traditional(h) for h in hyps)
    else:
        summary["wer"] = round(wer(refs, hyps), 4)
    return {**summary, "clips": rows}


def print_table(results: dict[str, dict], language: str, ratio: float | None) -> None:
    metric = "CER" if language == "zh" else "WER"
    header = f"{'engine':<12}{'median ms':>11}{'p90 ms':>10}{metric:>8}" + ("  trad" if language == "zh" else "")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        line = f"{name:<12}{r['median_ms']:>11.1f}{r['p90_ms']:>10.1f}{100 * r[metric.lower()]:>7.1f}%"
        if language == "zh":
            line += f"{r['traditional_outputs']:>4}/{len(r['clips'])}"
        print(line)
    if ratio is not None:
        print(f"ours / fw-int8 median latency: {ratio:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny.en", "base"], default="tiny.en")
    p.add_argument("--language", choices=["en", "zh"], default="en")
    p.add_argument("--clips", type=Path, help="folder of NAME.wav + NAME.txt (default for en: tests/data/librivox)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per clip; the median is kept")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/compare-MODEL-LANGUAGE.json)")
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated subset of {','.join(ENGINES)}; ours-POLICY runs ours with another encoder policy",
    )
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := {e for e in args.engines if not e.startswith("ours-")} - set(ENGINES):
        p.error(f"unknown engines: {', '.join(sorted(unknown))}")
    if args.model.endswith(".en") and args.language != "en":
        p.error(f"{args.model} is English-only")
    if args.clips is None:
        if args.language not in DEFAULT_CLIPS:
            p.error(f"--clips is required for --language {args.language}")
        args.clips = Path(DEFAULT_CLIPS[args.language])
    args.out = args.out or Path("benchmarks/results") / f"compare-{args.model}-{args.language}.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()  # other busy processes skew CPU timings; keep a trace
    clips = load_clips(args.clips)
    results: dict[str, dict] = {}
    for name in args.engines:
        transcribe = make_engine(name, args.model, args.language, args.threads)
        results[name] = run_engine(name, transcribe, clips, args.repeat, args.language)
        del transcribe  # free one model before loading the next

    ratio = None
    if "ours" in results and "fw-int8" in results:
        ratio = round(results["ours"]["median_ms"] / results["fw-int8"]["median_ms"], 3)
    print_table(results, args.language, ratio)

    import ctranslate2
    import faster_whisper
    import onnxruntime

    report = {
        "model": args.model, "language": args.language, "clips_dir": str(args.clips), "clips": len(clips),
        "threads": args.threads, "repeat": args.repeat, "prompt": PROMPTS[args.language],
        "ratio_ours_to_fw_int8_median": ratio,
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                        "faster_whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__,
                        "onnxruntime": onnxruntime.__version__,
                        "load_avg_1_5_15_before": load_before, "load_avg_1_5_15_after": os.getloadavg()},
        "engines": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
