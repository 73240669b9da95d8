"""`--vad-hangover-ms` of `streamserver gateway` and `serve`: checked on the command line and
carried to every student's segmenter (the silence that ends an utterance, a floor under every
measured latency)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiohttp import web

from streamserver import cli
from streamserver.api.app import CLASSROOM
from streamserver.audio.pacing import Pacer
from tests.takers import SpeechList


class Collector:
    """Stands in for the job queue / ASR worker: keeps what the segmenter emits."""

    def __init__(self) -> None:
        self.utterances: list = []

    def submit(self, utterance) -> None:  # noqa: ANN001 - an Utterance
        self.utterances.append(utterance)

    def hint(self, utterance) -> None:  # noqa: ANN001 - a partial or speculative Utterance
        pass


def _app(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> web.Application:
    """The app the command would serve, without serving it."""
    served: list[web.Application] = []
    monkeypatch.setattr(web, "run_app", lambda app, **_: served.append(app))
    monkeypatch.setenv("STREAMSERVER_SECRET", "hangover-test-secret")  # a gateway refuses to start without one
    assert cli.main(argv) == 0
    return served[0]


def _silence_until_emitted(app: web.Application, speech: np.ndarray) -> int:
    """Milliseconds of digital silence after `speech` before the student's utterance is emitted,
    fed in 20 ms chunks as the WebSocket ingest and the load simulator do."""
    classroom = app[CLASSROOM]
    collector = Collector()
    classroom.sink = collector

    async def run() -> int:
        room = classroom.rooms.create("hangover", "en")
        audio = classroom.student_audio(room, "s1", "Ann", pacer=Pacer(rate=1e9))  # fed faster than real time
        assert audio._segmenter.config is classroom.segmenter_config
        for i in range(0, speech.size, 320):
            audio.push_pcm16(speech[i : i + 320])
        assert not collector.utterances
        for ms in range(20, 3000, 20):
            audio.push_pcm16(np.zeros(320, np.int16))
            if collector.utterances:
                return ms
        raise AssertionError("no utterance after 3 s of silence")

    ms = asyncio.run(run())
    assert len(collector.utterances) == 1
    return ms


@pytest.fixture(scope="module")
def speech(librivox) -> np.ndarray:
    _, audio, _ = librivox[0]
    loud = np.flatnonzero(np.abs(audio) > 0.1 * np.abs(audio).max())
    audio = audio[: loud[-1] + 1]  # the clip's own trailing pause would count as hangover
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16)


def test_gateway_hangover_reaches_the_segmenter(monkeypatch, speech):
    base = ["gateway", "--redis-url", "redis://127.0.0.1:1/0"]  # never contacted: the app is not served
    default = _app(monkeypatch, base)
    short = _app(monkeypatch, [*base, "--vad-hangover-ms", "300"])
    assert default[CLASSROOM].segmenter_config.hangover_ms == 500
    config = short[CLASSROOM].segmenter_config
    assert (config.hangover_ms, config.post_roll_ms) == (300, 200)
    # 30 ms VAD frames: 17 frames (510 ms) end an utterance by default, 10 (300 ms) with 300.
    waited_default, waited_short = _silence_until_emitted(default, speech), _silence_until_emitted(short, speech)
    assert 180 <= waited_default - waited_short <= 240, (waited_default, waited_short)


def test_serve_hangover_reaches_the_segmenter(monkeypatch):
    class Engine:  # serve's engine is only handed to its in-process worker here
        multilingual = False
        batch_rows_cheap = False  # a CPU's, as engines/engine.py declares

    monkeypatch.setattr(cli, "_warm_engine_and_intent", lambda *a: (Engine(), None))
    app = _app(monkeypatch, ["serve", "--vad-hangover-ms", "250"])
    config = app[CLASSROOM].segmenter_config
    assert (config.hangover_ms, config.post_roll_ms) == (250, 200)


@pytest.mark.parametrize("value", ["100", "249", "2001", "0.5", "x"])
def test_hangover_out_of_range_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--vad-hangover-ms", value])
    assert exit_.value.code == 2
    assert "--vad-hangover-ms" in capsys.readouterr().err


@pytest.mark.parametrize("hangover_ms", [250, 300, 500])
def test_each_simulator_clip_is_one_utterance(hangover_ms):
    """The load simulator counts one utterance per clip (loadsim/scenario.py): true of every
    shipped clip at these hangovers, at each phase of the 30 ms VAD frames against its 20 ms ones."""
    from streamserver.audio.segmenter import SegmenterConfig, UtteranceSegmenter
    from streamserver.loadsim.scenario import MIN_GAP_S, RATE, load_clips

    for clip in load_clips(20):
        for lead_ms in (1000, 1020, 1040):
            got = SpeechList()
            segmenter = UtteranceSegmenter(SegmenterConfig.with_hangover(hangover_ms), got, clock=lambda: 0.0)
            pcm = np.concatenate([np.zeros(RATE * lead_ms // 1000, np.int16), np.frombuffer(clip.pcm, "<i2"),
                                  np.zeros(int(RATE * MIN_GAP_S), np.int16)])
            for i in range(0, pcm.size, 320):
                segmenter.feed(pcm[i : i + 320])
            assert len(got) == 1, (clip.name, lead_ms, [u.duration_s for u in got])
