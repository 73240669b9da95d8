"""Which encoder input length? Accuracy and speed of each policy in engines/policy.py.

For every policy: corpus WER (English) or CER (Mandarin) without and with the 30 s fallback for
rejected repetitions, how many utterances looped (hit the token budget or the compression
check) at the policy's own length, and the median latency of one utterance at a time.
Writes benchmarks/results/encoder-length.json and prints a table.

    .venv/bin/python -m benchmarks.encoder_length --set tiny.en:en:tests/data/librivox \\
        --set tiny.en:en:/work/shared/data/en_dev --set base:zh:/work/shared/data/zh_dev
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compare_faster_whisper import PROMPTS, load_clips  # noqa: E402
from benchmarks.scoring import cer, has_traditional, wer  # noqa: E402
from engines.loading import load_engine  # noqa: E402
from engines.policy import POLICIES  # noqa: E402


def evaluate(model: str, language: str, folder: Path, threads: int, policies: list[str], precision: str) -> list[dict]:
    clips = load_clips(folder)
    refs = [c.reference for c in clips]
    score = wer if language == "en" else cer
    rows = []
    for name in policies:
        engine = load_engine(model, threads=threads, policy=name, precision=precision)
        engine.warmup()
        raw, guarded, times = [], [], []
        for clip in clips:
            start = time.perf_counter()
            result = engine.transcribe_batch([clip.audio], language, PROMPTS[language])[0]
            times.append((time.perf_counter() - start) * 1000)
            guarded.append(result.text)
            raw.append(engine.transcribe_batch([clip.audio], language, PROMPTS[language], fallback=False)[0])
        row = {
            "model": model,
            "language": language,
            "clips": str(folder),
            "n": len(clips),
            "policy": name,
            "precision": precision,
            "error_rate_raw": round(score(refs, [r.text for r in raw]), 4),
            "error_rate": round(score(refs, guarded), 4),
            "loops": sum(r.rejected == "repetition" for r in raw),
            "traditional": sum(has_traditional(t) for t in guarded),
            "median_ms": round(statistics.median(times), 1),
        }
        print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", required=True, help="MODEL:LANGUAGE:CLIP_DIR, repeatable")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--precisions", default="fp32,int8")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/encoder-length.json"))
    args = parser.parse_args(argv)
    rows = []
    for spec in args.set:
        model, language, folder = spec.split(":", 2)
        for precision in args.precisions.split(","):
            rows += evaluate(model, language, Path(folder), args.threads, args.policies.split(","), precision)
    print(f"{'model':8} {'lang':4} {'set':28} {'policy':9} {'prec':4} {'err raw':>8} {'err':>7} {'loops':>5} {'trad':>4} {'median ms':>9}")
    for r in rows:
        print(
            f"{r['model']:8} {r['language']:4} {Path(r['clips']).name[:28]:28} {r['policy']:9} {r['precision']:4} "
            f"{r['error_rate_raw']:8.3f} {r['error_rate']:7.3f} {r['loops']:5d} {r['traditional']:4d} {r['median_ms']:9.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
