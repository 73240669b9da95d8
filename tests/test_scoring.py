"""Normalisation and error-rate checks on hand-made examples with known answers."""

import pytest

from benchmarks.scoring import cer, has_traditional, normalize_en, normalize_zh, wer


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("twenty five", "25"),
        ("twenty-five", "25"),
        ("1,000", "one thousand"),
        ("two million three hundred thousand and forty-two", "2,300,042"),
        ("one hundred and five", "105"),
        ("the first step", "the 1st step"),
        ("the twenty-first of May", "the 21st of may"),
        ("seven point five", "7.5"),
        ("Mr. Dashwood", "mister dashwood"),
        ("Mr Dashwood", "MR. DASHWOOD"),
        ("He's ill-disposed!", "hes ill disposed"),
        ("“Hello,” she said…", "hello she said"),
    ],
)
def test_normalize_en_equivalents(a: str, b: str) -> None:
    assert normalize_en(a) == normalize_en(b)


def test_normalize_en_keeps_separate_numbers_apart() -> None:
    assert normalize_en("one two three") == "1 2 3"
    assert normalize_en("Count: 1, 2, 3.") == "count 1 2 3"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("三角形的内角和是180度。", "三角形的内角和是一百八十度"),
        ("水在0度的时候会结冰", "水在零度的时候会结冰"),
        ("25", "二十五"),
        ("2", "二"),
        ("10", "十"),
        ("100", "一百"),
        ("1005", "一千零五"),
        ("20000", "二万"),
        ("３.14", "三点一四"),
        ("老师， 我可以去一下洗手间吗？ (ok!)", "老师我可以去一下洗手间吗ok"),
    ],
)
def test_normalize_zh(text: str, expected: str) -> None:
    assert normalize_zh(text) == expected


def test_wer_counts_corpus_edits_over_reference_words() -> None:
    refs = ["the cat sat on the mat", "hello world"]
    hyps = ["the cat sat on mat", "hello there world"]  # one deletion, one insertion
    assert wer(refs, hyps) == pytest.approx(2 / 8)
    assert wer(["Mr. Smith has 25 cats."], ["mister smith has twenty five cats"]) == 0.0
    assert wer(["a b c"], ["x y z"]) == 1.0


def test_cer_per_character() -> None:
    assert cer(["今天学习分数。"], ["今天学习分树"]) == pytest.approx(1 / 6)
    assert cer(["一百八十度"], ["180度"]) == 0.0
    assert cer(["你好", "再见"], ["你好", ""]) == pytest.approx(2 / 4)


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        wer(["a"], [])


def test_has_traditional() -> None:
    assert has_traditional("這個公式是怎麼推導出來的")
    assert not has_traditional("这个公式是怎么推导出来的")
    assert not has_traditional("hello 123")
