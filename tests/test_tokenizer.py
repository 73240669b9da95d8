from engines.tokenizer import WhisperTokenizer
from engines.weights import load_weights


def _tokenizer(model: str) -> WhisperTokenizer:
    w = load_weights(model)
    return WhisperTokenizer.load(w.folder, w.config, w.dims.n_vocab)


def test_round_trip_english_and_chinese():
    for model in ("tiny.en", "base"):
        tok = _tokenizer(model)
        for text in (" Could you explain the second step of the proof again?", " 老师，这道题的答案是二十五吗？", " émoji 🙂 ok"):
            ids = tok.encode(text)
            assert all(i < tok.eot for i in ids)
            assert tok.decode(ids) == text


def test_special_tokens_and_prefixes():
    tiny, base = _tokenizer("tiny.en"), _tokenizer("base")
    assert not tiny.multilingual and base.multilingual
    assert (tiny.eot, tiny.sot) == (50256, 50257)
    assert (base.eot, base.sot) == (50257, 50258)
    assert tiny.task_prefix(None) == [50362]  # English-only: no language or task token
    assert base.task_prefix("zh") == [50260, 50359, 50363]
    assert base.languages["en"] == 50259 and len(base.languages) == 99
    assert tiny.decode([tiny.sot, *tiny.encode(" hi"), tiny.eot]) == " hi"  # specials never reach text
