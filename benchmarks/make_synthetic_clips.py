"""Synthetic English classroom clips for policy and latency measurements (Debian's `flite`).

Each sentence of benchmarks/sentences_en.txt is spoken by a rotating flite voice and written as
NAME.wav (16 kHz mono) + NAME.txt into the output folder. Synthetic speech is easier than a
real classroom; it widens the dev set, it does not replace real recordings.

    apt-get install flite && .venv/bin/python -m benchmarks.make_synthetic_clips /tmp/en_synth
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

VOICES = ("slt", "kal16", "rms", "awb")


def main(out: Path) -> None:
    if shutil.which("flite") is None:
        raise SystemExit("flite is not installed (apt-get install flite)")
    out.mkdir(parents=True, exist_ok=True)
    sentences = Path(__file__).with_name("sentences_en.txt").read_text().splitlines()
    for i, sentence in enumerate(s for s in sentences if s.strip()):
        voice = VOICES[i % len(VOICES)]
        raw = out / f"synth_{i:02d}_{voice}.raw.wav"
        wav = raw.with_name(raw.name.replace(".raw", ""))
        subprocess.run(["flite", "-voice", voice, "-t", sentence, "-o", str(raw)], check=True)
        # flite writes 8 or 16 kHz depending on the voice; resample to 16 kHz mono with PyAV.
        from engines.audio import load_audio
        import wave

        import numpy as np

        audio = (np.clip(load_audio(raw), -1, 1) * 32767).astype(np.int16)
        with wave.open(str(wav), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
            w.writeframes(audio.tobytes())
        raw.unlink()
        wav.with_suffix(".txt").write_text(sentence + "\n")
    print(f"{len(sentences)} clips in {out}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/en_synth"))
