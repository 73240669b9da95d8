"""The engine on real weights and real speech."""

import numpy as np
import pytest

from benchmarks.scoring import wer
from engines.engine import split_on_quiet
from engines.features import as_float
from streamserver.queue.jobs import pcm16

RATE = 16000


def test_librivox_transcripts_are_accurate(tiny_engine, librivox):
    results = [tiny_engine.transcribe_batch([audio], "en")[0] for _, audio, _ in librivox]
    refs = [r for _, _, r in librivox]
    assert all(r.language == "en" and r.rejected is None for r in results)
    assert wer(refs, [r.text for r in results]) < 0.15


def test_batch_equals_one_at_a_time(tiny_engine, librivox):
    audios = [a for _, a, _ in librivox] + [librivox[0][1][: RATE * 2]]  # different lengths
    singles = [tiny_engine.transcribe_batch([a], "en")[0] for a in audios]
    batched = tiny_engine.transcribe_batch(audios, "en")
    assert [b.text for b in batched] == [s.text for s in singles]
    assert [b.encoder_frames for b in batched] == [s.encoder_frames for s in singles]


def test_pcm16_as_queued_transcribes_as_its_float32(tiny_engine, librivox):
    """A worker hands the engine a job's int16 PCM as it came from the queue: the same
    transcripts, to the last digit, as the same samples in float32."""
    pcm = [np.frombuffer(pcm16(a), "<i2") for _, a, _ in librivox]
    as_int = tiny_engine.transcribe_batch(pcm, "en")
    as_float32 = tiny_engine.transcribe_batch([as_float(p) for p in pcm], "en")
    assert [r.text for r in as_int] == [r.text for r in as_float32] and all(r.text for r in as_int)
    assert [r.avg_logprob for r in as_int] == [r.avg_logprob for r in as_float32]


def test_base_detects_english(base_engine, librivox):
    result = base_engine.transcribe_batch([librivox[1][1]], None)[0]
    assert result.language == "en"
    assert wer([librivox[1][2]], [result.text]) < 0.2


def _non_speech(seconds: float = 3.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    white = rng.normal(0, 0.1, n)
    brown = np.cumsum(rng.normal(0, 1, n))
    brown = 0.3 * (brown - brown.mean()) / np.abs(brown).max()
    chord = sum(0.1 * np.sin(2 * np.pi * f * t) for f in (261.63, 329.63, 392.0))  # C major
    clicks = np.zeros(n)
    clicks[:: RATE // 4] = 0.9
    return {
        "silence": np.zeros(n),
        "white": white,
        "brown": brown,
        "chord": chord,
        "clicks": clicks,
        "quiet_hiss": rng.normal(0, 0.003, n),
    }


@pytest.mark.parametrize("engine_name,language", [("tiny_engine", "en"), ("base_engine", None), ("base_engine", "zh")])
def test_non_speech_gives_no_words(engine_name, language, request):
    engine = request.getfixturevalue(engine_name)
    sounds = _non_speech()
    results = engine.transcribe_batch([s.astype(np.float32) for s in sounds.values()], language)
    assert {name: r.text for name, r in zip(sounds, results)} == {name: "" for name in sounds}


def test_long_audio_is_cut_at_quiet_points(librivox):
    audio = np.concatenate([a for _, a, _ in librivox] * 3)
    pieces = split_on_quiet(audio)
    assert sum(p.size for p in pieces) == audio.size
    assert all(p.size <= 30 * RATE for p in pieces) and len(pieces) >= 2


def test_bad_input_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="non-empty"):
        tiny_engine.transcribe_batch([np.zeros(0, np.float32)], "en")
    with pytest.raises(ValueError, match="over 30 s"):
        tiny_engine.transcribe_batch([np.zeros(31 * RATE, np.float32)], "en")


def test_traditional_characters_become_simplified(base_engine):
    assert base_engine._simplified("這個問題怎麼寫") == "这个问题怎么写"


def test_a_phrase_said_twice_counts_as_looped():
    from engines.engine import Transcript, looks_looped

    def t(text: str, rejected: str | None = None) -> Transcript:
        return Transcript(text, "en", 0.0, 0.0, 1.0, 1000, rejected)

    assert looks_looped(t("Yes, yes."))
    assert looks_looped(t("wait can you repeat the question wait can you repeat the question"))
    assert looks_looped(t("", "repetition"))
    assert not looks_looped(t("yes yes I know"))
    assert not looks_looped(t("Could you explain the second step again?"))
    assert not looks_looped(t(""))


def test_encoder_window_policies():
    from engines.policy import POLICIES

    second = RATE
    assert POLICIES["pad30"].frames(3 * second) == 3000
    assert POLICIES["min10s"].frames(3 * second) == 1000  # 1-8 s utterances share one window
    assert POLICIES["min10s"].frames(8 * second) == 1000
    assert POLICIES["min10s"].frames(12 * second) == 1500  # longer ones round up to 5 s steps
    assert POLICIES["min10s"].frames(29 * second) == 3000
    assert POLICIES["exact"].frames(int(2.345 * second)) == 236  # even: the stride-2 conv halves it
    assert POLICIES["min10s-zero"].frames(3 * second) == 1000 and POLICIES["min10s-zero"].pad_value == 0.0
