"""How the VAD's post-roll (audio kept after the last voiced frame) changes the transcripts.

A shorter post-roll lets the speculative final start sooner (it starts once the pause has lasted
the post-roll, streamserver/audio/segmenter.py), so on a slow CPU it is ready when the hangover
ends. Each clip is played through the real segmenter (1 s of silence before, 2 s after: digital
zeros, or white noise at about -50 dBFS) and its utterances are recognised with tiny.en.

    .venv/bin/python -m benchmarks.post_roll --out benchmarks/results/post-roll.json \
        ../shared/data/en_dev /tmp/en_synth

(/tmp/en_synth: `.venv/bin/python -m benchmarks.make_synthetic_clips /tmp/en_synth`, Debian flite.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compare_faster_whisper import load_clips  # noqa: E402
from benchmarks.scoring import wer  # noqa: E402
from engines.loading import load_engine  # noqa: E402
from streamserver.audio.segmenter import SegmenterConfig, UtteranceSegmenter  # noqa: E402

NOISE_RMS = 100  # int16: about -50 dBFS, a quiet room through a laptop microphone


def segmented(audio: np.ndarray, post_roll_ms: int, noise: np.random.Generator | None) -> list[np.ndarray]:
    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype(np.int16)  # load_audio's float, back to the file's samples
    stream = np.concatenate([np.zeros(16000, np.int16), pcm, np.zeros(32000, np.int16)])
    if noise is not None:
        stream = np.clip(stream + noise.normal(0, NOISE_RMS, stream.size), -32768, 32767).astype(np.int16)
    found: list = []

    class Found:  # the segmenter's SpeechTaker: the utterances it cuts
        speech = found.append

        def speech_so_far(self, _speech) -> None:  # noqa: ANN001
            pass

    segmenter = UtteranceSegmenter(SegmenterConfig(post_roll_ms=post_roll_ms), Found())
    for i in range(0, stream.size, 320):  # 20 ms messages, as the clients send
        segmenter.feed(stream[i : i + 320])
    segmenter.flush()
    return [u.audio for u in found]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", type=Path, nargs="+", help="folders of NAME.wav (16 kHz mono) + NAME.txt")
    p.add_argument("--post-rolls", default="300,200,150", help="milliseconds, comma-separated")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    clips = [clip for folder in args.folders for clip in load_clips(folder)]
    engine = load_engine("tiny.en", threads=2)
    rolls = [int(ms) for ms in args.post_rolls.split(",")]
    results: dict[str, dict] = {}
    for background in ("zeros", "noise"):
        for ms in rolls:
            rng = np.random.default_rng(0) if background == "noise" else None
            hyps = []
            for clip in clips:
                pieces = segmented(clip.audio, ms, rng)
                hyps.append(" ".join(r.text for r in engine.transcribe_batch(pieces)) if pieces else "")
            score = wer([clip.reference for clip in clips], hyps)
            results[f"{background}/{ms}"] = {"wer": round(score, 4), "transcripts": dict(zip([c.name + ".wav" for c in clips], hyps))}
            print(f"{background:5} post-roll {ms:3} ms: WER {score:.2%} ({len(clips)} clips)", flush=True)
    args.out.write_text(json.dumps({"clips": len(clips), "model": "tiny.en", "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
