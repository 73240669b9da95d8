"""The data path is written as code (streamserver/stages.py): each stage hands on to the next
through a typed interface, never through a bare Callable that only the wiring explains.

Read with `ast`: every parameter of every function in the stage packages whose annotation is a
Callable (directly, or through a module-level alias such as `Keep = Callable[...]`) must be one
of the hooks below, each of which carries something other than the utterance's data (a clock, a
lifecycle signal, a question, a room event); and the hops that stages.py names take its types.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from streamserver import stages

ROOT = Path(__file__).resolve().parents[1] / "streamserver"
STAGE_PACKAGES = ("transport", "audio", "queue", "asr", "bus")

# Callable parameters that are not a hop of the data path, and why.
HOOKS = {
    "clock": "a time source",
    "on_refused": "a count for the metrics",
    "on_end": "the stream ended: a lifecycle signal to its owner",
    "on_error": "a failure to log: the stream goes on",
    "utterance_open": "the transport asks the audio stage whether to hand on a silent sender's silence",
    "on_channel": "the page's recovery channel, to its owner",
    "current": "whether the stream is still the student's",
    "keep": "where the page's kept audio lies on its clock: control, not audio",
    "send": "replies to the page on its recovery channel",
    "tell": "a message to the client (an ack, \"ended\"): control, not audio",
    "pacer": "makes a pacer",
    "on_speaking": "the room's 'speaking' mark: an event, not the data path",
    "share_of": "a sort key: an item's room and source",
}


def _is_callable(annotation: ast.expr | None, aliases: set[str]) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    return "Callable" in text or any(alias in text.replace("|", " ").split() for alias in aliases)


def _callable_parameters(path: Path, label: str) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {t.id for node in tree.body if isinstance(node, ast.Assign) and "Callable" in ast.unparse(node.value)
               for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                if _is_callable(arg.annotation, aliases):
                    found.append(f"{label}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_stage_takes_a_bare_callable_for_the_next_stage():
    offenders = []
    seen = 0
    for package in STAGE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for where in _callable_parameters(path, path.relative_to(ROOT.parent).as_posix()):
                seen += 1
                if where.rsplit("(", 1)[1].rstrip(")") not in HOOKS:
                    offenders.append(where)
    assert seen > 0  # the scan reads the packages (the hooks above exist)
    assert not offenders, "hand on to the next stage through a stages.py interface, not a Callable:\n" + "\n".join(offenders)


def test_the_scan_sees_a_callable_hop(tmp_path):
    """The rule itself: a Callable for the next stage is found, directly or through an alias."""
    source = ("from typing import Callable\nPush = Callable[[bytes], None]\n"
              "def serve(on_pcm: Callable[[bytes], None], clock: Callable[[], float]) -> None: ...\n"
              "def other(push: Push | None = None) -> None: ...\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = [w.rsplit("(", 1)[1].rstrip(")") for w in _callable_parameters(path, "probe.py")]
    assert found == ["on_pcm", "clock", "push"]


def test_the_hops_named_in_stages_take_its_types():
    from streamserver.api import app  # noqa: F401 - the wiring imports cleanly
    from streamserver.asr.batch import BatchRecogniser
    from streamserver.audio.pipeline import StudentAudio
    from streamserver.audio.segmenter import UtteranceSegmenter
    from streamserver.bus.ordered import OrderedPublisher
    from streamserver.queue.sink import UtteranceSink
    from streamserver.transport import rtp_audio, webrtc, ws_ingest

    def annotation(function, name: str) -> str:  # noqa: ANN001
        return str(inspect.signature(function).parameters[name].annotation)

    assert annotation(webrtc.answer, "stream") == "PcmTaker"
    assert annotation(ws_ingest.serve, "stream") == "PcmTaker"
    assert annotation(rtp_audio.install, "stream") == "PcmTaker"
    assert annotation(StudentAudio.__init__, "out") == "UtteranceTaker"
    assert annotation(UtteranceSegmenter.__init__, "out") == "SpeechTaker | None"
    # each stage is what the next one's interface asks for (structurally: the methods exist)
    for stage, interface in ((StudentAudio, stages.PcmTaker), (UtteranceSink, stages.UtteranceTaker),
                             (BatchRecogniser, stages.Recogniser), (OrderedPublisher, stages.RoomFeed)):
        wanted = [n for n in vars(interface) if not n.startswith("_")]
        assert wanted and all(callable(getattr(stage, n, None)) for n in wanted), (stage, interface)


def test_the_classroom_only_joins_and_leaves():
    """Classroom (streamserver/classroom.py) keeps to a student's join, reconnect and leave and
    the parts it starts: at most 150 lines, and the API reads a room's feed and health through
    its methods, not through its parts."""
    tree = ast.parse((ROOT / "classroom.py").read_text(encoding="utf-8"))
    (classroom,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Classroom"]
    assert classroom.end_lineno - classroom.lineno + 1 <= 150
    app = (ROOT / "api" / "app.py").read_text(encoding="utf-8")
    for part in (".local.", ".sink.fallback", ".upkeep.feeds", "bus.subscribe(", "bus.history("):
        assert part not in app, part
