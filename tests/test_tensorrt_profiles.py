"""TensorRT optimization profiles: pure logic, checked without TensorRT (engines/tensorrt/profiles.py)."""

from dataclasses import replace

import pytest

from engines.decoding import MAX_PROMPT_TOKENS
from engines.tensorrt.profiles import (
    MAX_HEAD_TOKENS, Profile, ProfileError, ShapeRange, engine_profiles, pick, settings_for, validate,
)
from engines.weights import Dimensions

TINY_EN = Dimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=384, n_audio_layer=4, n_text_ctx=448,
                     n_text_layer=4, n_heads=6, n_vocab=51864)
BASE = Dimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=512, n_audio_layer=6, n_text_ctx=448,
                  n_text_layer=6, n_heads=8, n_vocab=51865)


def _decoder_shapes(dims: Dimensions, batch: int, n: int, past: int, ctx: int = 500) -> dict[str, tuple[int, ...]]:
    hd = dims.n_audio_state // dims.n_heads
    shapes = {"tokens": (batch, n)}
    for i in range(dims.n_text_layer):
        for kv in "kv":
            shapes[f"self_{kv}_{i}"] = (batch, dims.n_heads, past, hd)
            shapes[f"cross_{kv}_{i}"] = (batch, dims.n_heads, ctx, hd)
    return shapes


def test_encoder_optimum_is_the_models_default_window_for_a_typical_utterance():
    base = engine_profiles(BASE, "base")["encoder"][0].shapes["mel"]
    tiny = engine_profiles(TINY_EN, "tiny.en")["encoder"][0].shapes["mel"]
    assert base == ShapeRange((1, 80, 100), (16, 80, 1000), (64, 80, 3000))  # min10s: 3 s -> 10 s window
    assert tiny.opt == (16, 80, 3000)  # pad30: always 30 s


def test_max_batch_is_configurable_and_shared_by_every_input():
    profiles = engine_profiles(BASE, "base", max_batch=8)
    for spec in profiles["encoder"] + profiles["decoder"]:
        assert {(r.min[0], r.opt[0], r.max[0]) for r in spec.shapes.values()} == {(1, 8, 8)}
    with pytest.raises(ProfileError):
        settings_for("base", max_batch=0)


def test_profiles_name_exactly_the_graph_inputs_with_the_graph_shapes():
    """Against the real portable graphs: a profile for an input the graph lacks fails the build."""
    from engines.graphs import FLAVOURS, build_decoder, build_encoder
    from engines.weights import load_weights

    weights = load_weights("tiny.en")
    assert weights.dims == TINY_EN
    profiles = engine_profiles(weights.dims, "tiny.en")
    for graph, build in (("encoder", build_encoder), ("decoder", build_decoder)):
        inputs = build(weights, FLAVOURS["portable"]).graph.input
        for spec in profiles[graph]:
            assert list(spec.shapes) == [i.name for i in inputs]
            for i in inputs:
                dims = i.type.tensor_type.shape.dim
                r = spec.shapes[i.name]
                assert len(r.min) == len(dims)
                for axis, d in enumerate(dims):
                    if d.HasField("dim_value"):  # a fixed axis: min = opt = max = the graph's value
                        assert r.min[axis] == r.opt[axis] == r.max[axis] == d.dim_value


def test_decoding_shapes_are_covered_or_split_into_single_steps():
    """Every call greedy decoding makes: the head on an empty cache (up to a 223-token prompt),
    the task prefix after it, then one token at a time up to the 448th position."""
    assert MAX_HEAD_TOKENS == MAX_PROMPT_TOKENS + 2
    decoder = engine_profiles(BASE, "base")["decoder"]
    assert [p.name for p in decoder] == ["step", "prefill"]
    for n in range(1, MAX_HEAD_TOKENS + 1):
        assert pick(decoder, _decoder_shapes(BASE, 4, n, 0)) is not None
    for past in range(0, 448):
        assert pick(decoder, _decoder_shapes(BASE, 64, 1, past)) == 0
    assert pick(decoder, _decoder_shapes(BASE, 3, 3, 1)) == 1  # base's task prefix after <|startoftranscript|>
    assert pick(decoder, _decoder_shapes(BASE, 3, 3, 225)) is None  # after a full prompt: token by token
    assert pick(decoder, _decoder_shapes(BASE, 65, 1, 5)) is None  # beyond max batch: the runtime chunks
    assert pick(decoder, _decoder_shapes(BASE, 1, 1, 5, ctx=1501)) is None


def test_validation_rejects_what_tensorrt_or_the_graphs_cannot_take():
    good = engine_profiles(BASE, "base")
    enc, step = good["encoder"][0], good["decoder"][0]

    def with_shape(p: Profile, name: str, r: ShapeRange) -> Profile:
        return replace(p, shapes={**p.shapes, name: r})

    bad = {
        "min <= opt": with_shape(enc, "mel", ShapeRange((1, 80, 200), (16, 80, 100), (64, 80, 3000))),
        "even": with_shape(enc, "mel", ShapeRange((1, 80, 101), (16, 80, 1000), (64, 80, 3000))),
        "exceed": with_shape(enc, "mel", ShapeRange((1, 80, 100), (16, 80, 1000), (64, 80, 3002))),
        "exactly 80": with_shape(enc, "mel", ShapeRange((1, 40, 100), (16, 80, 1000), (64, 80, 3000))),
        "has min 0": with_shape(enc, "mel", ShapeRange((0, 80, 100), (16, 80, 1000), (64, 80, 3000))),
    }
    for message, profile in bad.items():
        with pytest.raises(ProfileError, match=message):
            validate("encoder", [profile], BASE)
    too_long = ShapeRange((1, 8, 0, 64), (16, 8, 16, 64), (64, 8, 448, 64))  # + 1 token > 448 positions
    cache_names = [n for n in step.shapes if n.startswith("self_")]
    with pytest.raises(ProfileError, match="exceeds 448"):
        validate("decoder", [replace(step, shapes={**step.shapes, **{n: too_long for n in cache_names}})], BASE)
    other_batch = ShapeRange((1, 8, 0, 64), (8, 8, 16, 64), (32, 8, 447, 64))
    with pytest.raises(ProfileError, match="batch ranges"):
        validate("decoder", [replace(step, shapes={**step.shapes, **{n: other_batch for n in cache_names}})], BASE)
    with pytest.raises(ProfileError, match="same range"):
        validate("decoder", [with_shape(step, "self_k_0", replace(step.shapes["self_k_0"], opt=(16, 8, 17, 64)))], BASE)
    with pytest.raises(ProfileError, match=r"missing \['cross_v_5'\]"):
        validate("decoder", [replace(step, shapes={k: v for k, v in step.shapes.items() if k != "cross_v_5"})], BASE)
    with pytest.raises(ProfileError, match="exactly 4"):
        validate("decoder", [step], replace(BASE, n_heads=4))  # profiles of 8 heads for a 4-head model
    with pytest.raises(ProfileError, match="no profile"):
        validate("encoder", [], BASE)


def test_profiles_serialize_for_the_cache_key():
    spec = engine_profiles(TINY_EN, "tiny.en")["decoder"][1].as_json()
    assert spec["name"] == "prefill"
    assert spec["shapes"]["tokens"] == [[1, 1], [16, 3], [64, 225]]
    assert spec["shapes"]["self_k_0"] == [[1, 6, 0, 64], [16, 6, 1, 64], [64, 6, 223, 64]]
