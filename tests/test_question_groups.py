"""Question groups (streamserver/intent/groups.py): the mechanics on vectors made for the purpose,
and the grouping of real paraphrased questions embedded by the intent labeller's e5 (figures of
the whole set: benchmarks/question_groups.py)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.question_groups import embed, evaluate, load
from streamserver.intent.groups import QuestionGroups, RoomGroups, purity_completeness


def _as_is(vector: np.ndarray, language: str) -> np.ndarray:
    return vector  # vectors made for the purpose need no centring


def _unit(*parts: float) -> np.ndarray:
    v = np.array(parts, np.float32)
    return v / np.linalg.norm(v)


def test_a_question_joins_the_group_it_asks_or_opens_its_own():
    groups = QuestionGroups(threshold=0.9, max_groups=2, centring=_as_is)
    due = groups.add("u1", "ann", "when is the homework due", _unit(1, 0, 0), 1.0)
    again = groups.add("u2", "bo", "homework deadline?", _unit(1, 0.1, 0), 2.0)
    where = groups.add("u3", "cy", "where do I hand it in", _unit(0, 1, 0), 3.0)
    assert again is due and where is not due
    assert (due.count, len(due.students), due.utterances) == (2, 2, ["u1", "u2"])
    assert [g.group_id for g in groups.newest_first()] == [where.group_id, due.group_id]
    assert groups.mark_answered(due.group_id) and due.answered and not groups.mark_answered(99)
    groups.add("u4", "dee", "due date of the homework", _unit(1, 0.05, 0), 4.0)
    assert not due.answered and due.count == 3  # asked again: open again
    groups.add("u5", "eve", "can you speak louder", _unit(0, 0, 1), 5.0)  # a third group: the oldest goes
    assert where.group_id not in groups.groups and len(groups.groups) == 2


def test_the_representative_is_the_question_nearest_the_groups_centre():
    groups = QuestionGroups(threshold=0.8, centring=_as_is)
    edge = groups.add("u1", "a", "edge", _unit(1, 0.2, 0), 1.0)
    groups.add("u2", "b", "other edge", _unit(1, -0.2, 0), 2.0)
    groups.add("u3", "c", "centre", _unit(1, 0, 0), 3.0)
    assert edge.representative == "centre" and edge.to_dict()["count"] == 3


def test_purity_and_completeness():
    assert purity_completeness([0, 0, 1, 1], ["x", "x", "y", "y"]) == (1.0, 1.0)
    assert purity_completeness([0, 0, 1, 1], ["x", "x", "y", "z"]) == (0.75, 1.0)  # y and z share a group
    assert purity_completeness([0, 1, 2, 2], ["x", "x", "y", "y"]) == (1.0, 0.75)  # x is split in two


@pytest.fixture(scope="module")
def held_out() -> dict[str, dict]:
    rows = load()
    report = evaluate(rows, embed([r["text"] for r in rows]))
    return {lang: report[lang]["held_out_chosen"] for lang in ("en", "zh", "both")}


@pytest.mark.xfail(strict=True, reason="issue 29's 0.8 is not met on the 60-group set: held out, English "
                   "0.760 / 0.713, Mandarin 0.833 / 0.787, both languages 0.627 / 0.633 (benchmarks/README.md)")
@pytest.mark.parametrize("lang", ["en", "zh", "both"])
def test_paraphrased_questions_group_on_the_held_out_half(held_out: dict[str, dict], lang: str) -> None:
    """The benchmark's protocol on the real question set: the threshold chosen on the development
    half, the figures of the held-out half (benchmarks/README.md, "Question groups"), against the
    0.8 both ways that a teacher's view needs (issue 29)."""
    assert held_out[lang]["purity"] >= 0.8 and held_out[lang]["completeness"] >= 0.8, held_out[lang]


def test_held_out_grouping_stays_where_it_is(held_out: dict[str, dict]) -> None:
    """Today's held-out figures of the 60-group set as floors, so that a change to the grouping
    or the centring that makes it worse shows here."""
    floors = {"en": (0.76, 0.71), "zh": (0.83, 0.78), "both": (0.62, 0.63)}
    for lang, (purity, completeness) in floors.items():
        assert held_out[lang]["purity"] >= purity and held_out[lang]["completeness"] >= completeness, (lang, held_out[lang])


def test_a_worker_keeps_a_bounded_number_of_rooms_and_forgets_idle_ones():
    rooms = RoomGroups(max_rooms=2, idle_s=3600)
    a = rooms.of("a")
    assert rooms.of("a") is a
    rooms.of("b")
    rooms.of("a")  # a asked last: b is the least recently asked
    rooms.of("c")
    assert len(rooms) == 2 and rooms.of("a") is a
    idle = RoomGroups(idle_s=0.0)
    idle.of("x")
    idle.of("y")
    assert len(idle) == 1  # x silent past the idle time
