"""A lesson's worth of one student's speech for the recovery tests: sentences with pauses between,
as PCM16, and a way to check that each reached the teacher exactly once, in order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.audio import load_audio
from benchmarks.scoring import edit_distance, normalize_en

DATA = Path(__file__).resolve().parent / "data"
SENTENCES = [*sorted((DATA / "librivox").glob("*.wav")), *sorted((DATA / "flite").glob("flite_*.wav"))]
PAUSE_S = 1.5  # between sentences: three hangovers, so that each is an utterance of its own


def track(paths: list[Path] = SENTENCES, lead_s: float = 1.0, tail_s: float = 2.0) -> tuple[np.ndarray, list[str], list[float]]:
    """The sentences' audio in one float32 16 kHz track, their texts, and where each starts (s)."""
    parts, texts, starts, at = [np.zeros(int(lead_s * 16000), np.float32)], [], [], lead_s
    for path in paths:
        audio = load_audio(path)
        starts.append(at)
        texts.append(path.with_suffix(".txt").read_text().strip())
        parts += [audio, np.zeros(int(PAUSE_S * 16000), np.float32)]
        at += audio.size / 16000 + PAUSE_S
    parts.append(np.zeros(int(tail_s * 16000), np.float32))
    return np.concatenate(parts), texts, starts


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def agreement(said: str, heard: str) -> float:
    """The share of a sentence's words the transcript has right (1 - its word error rate, floored)."""
    ref = normalize_en(said).split()
    return max(0.0, 1 - edit_distance(ref, normalize_en(heard).split()) / max(1, len(ref)))


def match_sentences(texts: list[str], finals: list[str]) -> list[int]:
    """For each final (in order), the sentence it says (-1: none): a transcript matches the
    sentence whose words it gets most of right, if that is over half."""
    out = []
    for heard in finals:
        scores = [agreement(said, heard) for said in texts]
        best = int(np.argmax(scores))
        out.append(best if scores[best] > 0.5 else -1)
    return out


def wer(texts: list[str], finals: list[str]) -> float:
    ref = normalize_en(" ".join(texts)).split()
    return edit_distance(ref, normalize_en(" ".join(finals)).split()) / len(ref)


def sentence_errors(texts: list[str], finals: list[str]) -> list[int]:
    """Words wrong in each sentence, when finals[i] says texts[i] (match_sentences is 0, 1, ...)."""
    return [edit_distance(normalize_en(said).split(), normalize_en(heard).split()) for said, heard in zip(texts, finals)]


def errors_over(texts: list[str], finals: list[str], without_break: list[list[int]], *, per_sentence: int) -> float:
    """What a break cost, as a share of the track's words: the words a run got wrong beyond what
    the runs without a break got wrong, counted two ways, and the smaller taken.

    - Sentence by sentence, against the most the runs without a break got wrong in that sentence.
      This overstates when a flip of tiny.en moves: "ill-disposed" is in two sentences and flips
      in either (2 words). When all three runs without a break flip it in the third sentence and
      both break runs in the second instead (4 words wrong in each run, break or not), that is
      2 words over sentence by sentence, 0 in all.
    - In all, against the runs without a break on average. This understates only when the break
      run, besides what the break cost, got fewer words wrong elsewhere than those runs did on
      average.
    A break's real cost (words cut at the seam, a sentence twice) shows sentence by sentence
    always, and in all unless such luck makes up for it. That luck can hide as many words as the
    runs without a break get wrong on average, all of them in one sentence, so each sentence is
    held on its own too: one more than `per_sentence` words over in any sentence raises
    AssertionError, whatever the total."""
    got = sentence_errors(texts, finals)
    worst = [max(run[i] for run in without_break) for i in range(len(texts))]
    over = [max(0, e - w) for e, w in zip(got, worst)]
    lost = [i for i, words in enumerate(over) if words > per_sentence]
    if lost:
        raise AssertionError(f"sentences {lost} got more than {per_sentence} words wrong beyond the runs without a break "
                             f"(words over per sentence: {over}; heard {[finals[i] for i in lost]}, said {[texts[i] for i in lost]})")
    in_all = max(0.0, sum(got) - sum(sum(run) for run in without_break) / len(without_break))
    return min(sum(over), in_all) / len(normalize_en(" ".join(texts)).split())
