"""Questions of a lecture grouped by what they ask: the hall view of a room of thousands, where
a line per question is more than a teacher can read.

Each question's sentence embedding (the intent labeller's multilingual-e5-small vector,
L2-normalised: model.Embedder) is first centred: e5 vectors share a large common component (any
two questions have a cosine near 0.9), and a Mandarin and an English question differ by a
language offset larger than what they ask. So the room's running mean of its questions in that
language is subtracted, that mean starting from a prior computed on a generic classroom corpus
(question_centre.npz) so the room's first questions are centred too; then the corpus's dominant
direction is removed and the vector re-normalised. The centred question joins the open group
whose centroid is most similar to it, when that similarity reaches SAME_QUESTION; otherwise it
opens a group of its own. A group keeps its count, its students, a representative question (the
member nearest its centroid) and when it last grew; a group the teacher marks answered reopens
when the question comes again. Online and in arrival order, as the questions of a live class
come: one comparison against each group's centroid per question (a matrix-vector product), so a
hall's ~100 questions a second cost little. benchmarks/question_groups.py measures it on
paraphrased questions in English and Mandarin and makes question_centre.npz
(benchmarks/README.md, "Question groups").

The grouping stays this simple because what limits it is the vector: on the benchmark's
development half a question is nearest its own group's centroid for only 84 % of the English
ones even with the groups known, and average linkage, a threshold rising with group size, more
directions removed, IDF-weighted content words and Mandarin character n-grams beside the
vector, and merging near groups in a second pass all measure within the noise of this
(benchmarks/README.md), so none is worth its cost per question. A better vector does help: e5's
and multilingual USE's cosines averaged group better in every setting, yet still short of 0.8
completeness, for a second model in every worker, so the worker keeps e5's alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Cosine similarity of centred vectors from which two questions ask the same thing (chosen on the
# development half of the paraphrase set's groups with both languages in one room, as a live
# room's are: benchmarks/question_groups.py).
SAME_QUESTION = 0.24
MAX_GROUPS = 2000  # the oldest groups go past this (a class of hours)
CENTRE_PATH = Path(__file__).with_name("question_centre.npz")
# Weight of the corpus prior in a room's mean, in questions: enough to centre the first few
# questions, few enough that a room's own lecture topic dominates after a dozen.
PRIOR_WEIGHT = 10.0
# A worker keeps the groups of at most this many rooms, none silent (no question) this long.
ROOMS_KEPT = 1000
ROOM_IDLE_S = 4 * 3600.0


@dataclass
class Group:
    group_id: int
    representative: str
    count: int = 0
    students: set[str] = field(default_factory=set)
    utterances: list[str] = field(default_factory=list)
    last_at: float = 0.0
    answered: bool = False
    _vector: np.ndarray | None = field(default=None, repr=False)  # the representative's, centred

    def to_dict(self) -> dict:
        return {"group_id": self.group_id, "question": self.representative, "count": self.count,
                "students": len(self.students), "last_at": self.last_at, "answered": self.answered}


class Centring:
    """A room's running mean of its question vectors per language, started from the corpus's
    mean for that language (its mean over all languages for one it lacks), and the corpus's
    dominant direction, which separates kinds of utterance rather than questions."""

    def __init__(self, path: Path = CENTRE_PATH, prior_weight: float = PRIOR_WEIGHT) -> None:
        data = np.load(path)
        self._priors = {name: data[name].astype(np.float64) for name in data.files if name != "top"}
        self._top = data["top"].astype(np.float32)
        self._prior_weight = prior_weight
        self._sums: dict[str, np.ndarray] = {}
        self._counts: dict[str, float] = {}

    def __call__(self, vector: np.ndarray, language: str) -> np.ndarray:
        """The question's vector, counted into its language's mean, centred and re-normalised."""
        if language not in self._sums:
            prior = self._priors.get(language, self._priors["all"])
            self._sums[language], self._counts[language] = prior * self._prior_weight, self._prior_weight
        self._sums[language] += vector
        self._counts[language] += 1
        centred = (vector - self._sums[language] / self._counts[language]).astype(np.float32)
        centred -= (centred @ self._top) * self._top
        return centred / max(float(np.linalg.norm(centred)), 1e-12)


class QuestionGroups:
    def __init__(self, threshold: float = SAME_QUESTION, max_groups: int = MAX_GROUPS,
                 centring: Callable[[np.ndarray, str], np.ndarray] | None = None) -> None:
        self.threshold, self.max_groups = threshold, max_groups
        self.centring = centring or Centring()
        self.groups: dict[int, Group] = {}
        self._sums = np.zeros((0, 0), np.float32)  # one row per group: the sum of its members' centred vectors
        self._ids: list[int] = []  # the group of each row
        self._next = 0

    def add(self, utterance_id: str, student_id: str, text: str, vector: np.ndarray, at: float,
            language: str = "") -> Group:
        """File a question (its L2-normalised embedding, the language it was spoken in) under its
        group, made if new."""
        vector = self.centring(np.asarray(vector, np.float32), language)
        row = self._nearest(vector)
        if row is None:
            group = self._open(text, vector)
            row = len(self._ids) - 1
        else:
            group = self.groups[self._ids[row]]
            self._sums[row] += vector
        group.count += 1
        group.students.add(student_id)
        group.utterances.append(utterance_id)
        group.last_at = at
        group.answered = False  # asked again: open until the teacher says otherwise
        centroid = self._sums[row] / np.linalg.norm(self._sums[row])
        if group._vector is None or float(centroid @ vector) > float(centroid @ group._vector):
            group.representative, group._vector = text, vector
        return group

    def mark_answered(self, group_id: int) -> bool:
        group = self.groups.get(group_id)
        if group is None:
            return False
        group.answered = True
        return True

    def newest_first(self, limit: int = 50) -> list[Group]:
        return sorted(self.groups.values(), key=lambda g: g.last_at, reverse=True)[:limit]

    def _nearest(self, vector: np.ndarray) -> int | None:
        if not self._ids:
            return None
        norms = np.linalg.norm(self._sums, axis=1)
        similarity = (self._sums @ vector) / norms
        best = int(np.argmax(similarity))
        return best if similarity[best] >= self.threshold else None

    def _open(self, text: str, vector: np.ndarray) -> Group:
        if len(self._ids) >= self.max_groups:
            oldest = min(range(len(self._ids)), key=lambda r: self.groups[self._ids[r]].last_at)
            del self.groups[self._ids.pop(oldest)]
            self._sums = np.delete(self._sums, oldest, axis=0)
        group = Group(self._next, text)
        self._next += 1
        self.groups[group.group_id] = group
        self._ids.append(group.group_id)
        self._sums = vector[None, :].copy() if self._sums.size == 0 else np.vstack([self._sums, vector])
        return group


class RoomGroups:
    """Each room's QuestionGroups, as a worker keeps them: a room without a question for
    `idle_s`, or the least recently asked past `max_rooms`, is forgotten (its groups start anew
    if it asks again)."""

    def __init__(self, max_rooms: int = ROOMS_KEPT, idle_s: float = ROOM_IDLE_S) -> None:
        self.max_rooms, self.idle_s = max_rooms, idle_s
        self._rooms: OrderedDict[str, tuple[QuestionGroups, float]] = OrderedDict()  # least recently asked first

    def __len__(self) -> int:
        return len(self._rooms)

    def of(self, room_id: str) -> QuestionGroups:
        """The room's groups (new ones for a room not kept), its use noted."""
        at = time.monotonic()
        while self._rooms:
            oldest, (_, used) = next(iter(self._rooms.items()))
            if at - used < self.idle_s and len(self._rooms) < self.max_rooms or oldest == room_id:
                break
            del self._rooms[oldest]
        groups = self._rooms.pop(room_id, (None, 0.0))[0] or QuestionGroups()
        self._rooms[room_id] = (groups, at)
        return groups


def purity_completeness(found: list[int], truth: list[str]) -> tuple[float, float]:
    """Purity (each group found holds one true question: the share of items in their group's
    most common true question) and completeness (each true question lands in one group: the
    share of items in their true question's most common group found)."""
    n = len(found)
    pairs = list(zip(found, truth))

    def share(key: int) -> float:
        tally: dict = {}
        for pair in pairs:
            tally.setdefault(pair[key], {}).setdefault(pair[1 - key], 0)
            tally[pair[key]][pair[1 - key]] += 1
        return sum(max(counts.values()) for counts in tally.values()) / n

    return share(0), share(1)
