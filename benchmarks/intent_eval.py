"""Intent classification on the held-out test split of benchmarks/intent/utterances.jsonl.

Prints accuracy, macro-F1, recall per label and per language, the share left unlabelled (null),
and the latency of one utterance at a time; the same run scores a peer, nearest-centroid on the
same embeddings, so the text cues and the trained layer are measured against the plain
embedding. Writes benchmarks/results/intent.json.

    .venv/bin/python -m benchmarks.intent_eval
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.intent.train import DATA, load  # noqa: E402
from streamserver.intent import LABELS  # noqa: E402
from streamserver.intent.model import EmbeddingIntentClassifier  # noqa: E402

NULL = -1


def rows(split: str) -> list[dict]:
    data = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in data if r["split"] == split]


def scores(y: np.ndarray, pred: np.ndarray, langs: list[str]) -> dict:
    f1s, recall = [], {}
    for k, label in enumerate(LABELS):
        tp = int(((pred == k) & (y == k)).sum())
        precision = tp / max(1, int((pred == k).sum()))
        rec = tp / max(1, int((y == k).sum()))
        f1s.append(0.0 if tp == 0 else 2 * precision * rec / (precision + rec))
        recall[label] = round(rec, 3)
    by_lang = {}
    for lang in sorted(set(langs)):
        mask = np.array([l == lang for l in langs])
        by_lang[lang] = {
            label: round(float(((pred == k) & (y == k) & mask).sum() / max(1, ((y == k) & mask).sum())), 3)
            for k, label in enumerate(LABELS)
        }
    return {
        "accuracy": round(float((pred == y).mean()), 4),
        "macro_f1": round(float(np.mean(f1s)), 4),
        "null_share": round(float((pred == NULL).mean()), 4),
        "recall": recall,
        "recall_by_language": by_lang,
    }


def main() -> None:
    test = rows("test")
    texts, langs = [r["text"] for r in test], [r["lang"] for r in test]
    y = np.array([LABELS.index(r["label"]) for r in test])
    model = EmbeddingIntentClassifier()
    model.classify(["warm up"])
    times, pred = [], []
    for text in texts:
        start = time.perf_counter()
        intent = model.classify([text])[0]
        times.append((time.perf_counter() - start) * 1000)
        pred.append(NULL if intent.label is None else LABELS.index(intent.label))
    ours = scores(y, np.array(pred), langs)
    ours["latency_ms"] = {"p50": round(statistics.median(times), 2), "p90": round(float(np.percentile(times, 90)), 2)}

    train_texts, train_y = load("train")  # the same training lines as ours
    emb_train = model.embedder.embed(train_texts)
    centroids = np.stack([emb_train[train_y == k].mean(axis=0) for k in range(len(LABELS))])
    peer = scores(y, (model.embedder.embed(texts) @ centroids.T).argmax(axis=1), langs)

    report = {"test_utterances": len(test), "ours": ours, "peer_nearest_centroid": peer}
    for name, r in (("ours (embedding + cues, softmax)", ours), ("peer: nearest centroid", peer)):
        print(f"{name}: accuracy {r['accuracy']:.3f}  macro-F1 {r['macro_f1']:.3f}  null {r['null_share']:.1%}")
        for lang, rec in r["recall_by_language"].items():
            print(f"   recall {lang:5}: " + "  ".join(f"{k} {v:.2f}" for k, v in rec.items()))
    print(f"latency per utterance: p50 {ours['latency_ms']['p50']} ms, p90 {ours['latency_ms']['p90']} ms")
    out = Path("benchmarks/results/intent.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
