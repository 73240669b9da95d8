import shutil

import pytest

from engines import weights
from engines.weights import WeightsError, load_weights, read_ct2


def test_dimensions_from_the_packaged_files():
    tiny, base = load_weights("tiny.en").dims, load_weights("base").dims
    assert (tiny.n_audio_layer, tiny.n_audio_state, tiny.n_heads, tiny.n_vocab) == (4, 384, 6, 51864)
    assert (base.n_audio_layer, base.n_audio_state, base.n_heads, base.n_vocab) == (6, 512, 8, 51865)


def test_truncated_file_is_a_clear_error(tmp_path):
    source = load_weights("tiny.en").folder / "model.bin"
    cut = tmp_path / "model.bin"
    with source.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(1_000_000))
    with pytest.raises(WeightsError, match="truncated"):
        weights._verified(cut, weights.MODELS["tiny.en"])
    with pytest.raises(WeightsError, match="ends inside"):
        read_ct2(cut)


def test_corrupt_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.bin"
    shutil.copyfile(load_weights("tiny.en").folder / "model.bin", bad)
    with bad.open("r+b") as f:
        f.seek(10_000_000)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(WeightsError, match="sha256"):
        weights._verified(bad, weights.MODELS["tiny.en"])


def test_unknown_model():
    with pytest.raises(WeightsError, match="unknown model"):
        load_weights("large-v9")
