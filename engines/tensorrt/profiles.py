"""Optimization profiles for the portable ONNX graphs: the shapes a TensorRT engine accepts.

TensorRT compiles kernels for a range of input shapes per profile (min..max) and tunes them for
one (opt). Our graphs (engines/graphs.py) have dynamic batch, encoder length and cache length:
  encoder  mel [batch, 80, frames]                       -> cross_k_i/cross_v_i [batch, H, frames/2, hd]
  decoder  tokens [batch, n], self_k_i/self_v_i [batch, H, past, hd], cross_k_i/cross_v_i [batch, H, ctx, hd]
The decoder has no position input: it reads `past` off the cache's shape, so the first step runs
on empty caches (past = 0) and every profile that sees a first step must allow 0.

Decoder profiles, in the order the runtime tries them:
  step     one token, past 0..447: every decoding step, and the first step without a prompt.
  prefill  several tokens after a short cache: a prompt ([<|startofprev|>, prompt, <|startoftranscript|>]
           on an empty cache) and the task prefix after it (base: 3 tokens after the head).
A shape neither covers (the task prefix after a full 223-token prompt: past 225 + 3 > the prefill's
223) is run one token at a time through `step`, which gives the same logits.
Pure Python: validated and tested without TensorRT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from engines.features import SAMPLE_RATE
from engines.policy import POLICIES, default_policy
from engines.weights import Dimensions

Shape = tuple[int, ...]

# <|startofprev|> + engines.decoding.MAX_PROMPT_TOKENS (223) + <|startoftranscript|>; not imported
# from there because decoding pulls in the tokenizer, which the GPU check machine lacks.
MAX_HEAD_TOKENS = 225
TYPICAL_UTTERANCE_S = 3.0  # a classroom answer or question; the encoder's optimum is its window
TYPICAL_TEXT_TOKENS = 16  # prefix + the words of such an utterance: the step's optimum cache length


class ProfileError(ValueError):
    """A profile TensorRT would reject, or one that admits shapes our graphs cannot run."""


@dataclass(frozen=True)
class ShapeRange:
    min: Shape
    opt: Shape
    max: Shape

    def covers(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max))

    def as_json(self) -> list[list[int]]:
        return [list(self.min), list(self.opt), list(self.max)]


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: Mapping[str, ShapeRange]  # one entry per graph input

    def covers(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        return shapes.keys() == self.shapes.keys() and all(self.shapes[k].covers(s) for k, s in shapes.items())

    def as_json(self) -> dict:
        return {"name": self.name, "shapes": {k: r.as_json() for k, r in self.shapes.items()}}


@dataclass(frozen=True)
class ProfileSettings:
    """The ranges the profiles are made from; frames are mel frames (100 a second)."""

    max_batch: int = 64
    opt_batch: int = 16
    min_frames: int = 100  # 1 s
    opt_frames: int = 1000
    max_frames: int = 3000  # 30 s, Whisper's window


def settings_for(model: str, max_batch: int = ProfileSettings.max_batch) -> ProfileSettings:
    """Ranges for a model: the optimum at the window its default encoder policy gives a typical
    utterance (base: min10s -> 1000 frames; tiny.en: pad30 -> 3000), which is what it will see."""
    if max_batch < 1:
        raise ProfileError(f"max batch must be at least 1, got {max_batch}")
    opt_frames = POLICIES[default_policy(model)].frames(int(TYPICAL_UTTERANCE_S * SAMPLE_RATE))
    return ProfileSettings(max_batch=max_batch, opt_batch=min(16, max_batch), opt_frames=opt_frames)


def _batched(rest_min: Shape, rest_opt: Shape, rest_max: Shape, s: ProfileSettings) -> ShapeRange:
    return ShapeRange((1, *rest_min), (s.opt_batch, *rest_opt), (s.max_batch, *rest_max))


def encoder_profiles(dims: Dimensions, s: ProfileSettings) -> list[Profile]:
    mel = _batched((dims.n_mels, s.min_frames), (dims.n_mels, s.opt_frames), (dims.n_mels, s.max_frames), s)
    return [Profile("encoder", {"mel": mel})]


def _decoder_profile(name: str, dims: Dimensions, s: ProfileSettings, tokens: Shape, past: Shape) -> Profile:
    """tokens and past: (min, opt, max) of the token count n and of the cache length."""
    heads, hd = dims.n_heads, dims.n_audio_state // dims.n_heads
    ctx = tuple(f // 2 for f in (s.min_frames, s.opt_frames, s.max_frames))  # the encoder halves frames
    shapes = {"tokens": _batched((tokens[0],), (tokens[1],), (tokens[2],), s)}
    cache = _batched(*((heads, p, hd) for p in past), s)
    cross = _batched(*((heads, c, hd) for c in ctx), s)
    for i in range(dims.n_text_layer):
        shapes |= {f"self_k_{i}": cache, f"self_v_{i}": cache, f"cross_k_{i}": cross, f"cross_v_{i}": cross}
    return Profile(name, shapes)


def decoder_profiles(dims: Dimensions, s: ProfileSettings) -> list[Profile]:
    limit = dims.n_text_ctx  # past + n <= 448
    head = min(MAX_HEAD_TOKENS, limit - 1)
    return [
        _decoder_profile("step", dims, s, tokens=(1, 1, 1), past=(0, TYPICAL_TEXT_TOKENS, limit - 1)),
        # opt: base's task prefix (<|en|><|transcribe|><|notimestamps|>) after <|startoftranscript|>
        _decoder_profile("prefill", dims, s, tokens=(1, 3, head), past=(0, 1, limit - head)),
    ]


def engine_profiles(dims: Dimensions, model: str, max_batch: int = ProfileSettings.max_batch) -> dict[str, list[Profile]]:
    """Validated profiles for both engines of a model: {"encoder": [...], "decoder": [...]}."""
    s = settings_for(model, max_batch)
    profiles = {"encoder": encoder_profiles(dims, s), "decoder": decoder_profiles(dims, s)}
    for graph, specs in profiles.items():
        validate(graph, specs, dims)
    return profiles


def pick(profiles: Sequence[Profile], shapes: Mapping[str, Sequence[int]]) -> int | None:
    """The index of the first profile that admits these input shapes, or None."""
    return next((i for i, p in enumerate(profiles) if p.covers(shapes)), None)


# --- validation ----------------------------------------------------------------------------


def validate(graph: str, profiles: Sequence[Profile], dims: Dimensions) -> None:
    """Raise ProfileError for anything TensorRT would reject or our graphs cannot run."""
    if not profiles:
        raise ProfileError(f"{graph}: no profile")
    names = _input_names(graph, dims)
    for p in profiles:
        where = f"{graph} profile {p.name!r}"
        if list(p.shapes) != names:
            missing, unknown = [n for n in names if n not in p.shapes], [n for n in p.shapes if n not in names]
            raise ProfileError(f"{where}: inputs are not the graph's (missing {missing}, unknown {unknown}, or reordered)")
        for name, r in p.shapes.items():
            _check_range(f"{where}, {name}", r, allow_zero=(2,) if name.startswith("self_") else ())
        batches = {(r.min[0], r.opt[0], r.max[0]) for r in p.shapes.values()}
        if len(batches) != 1:
            raise ProfileError(f"{where}: inputs share the batch dimension but have batch ranges {sorted(batches)}")
        (_check_encoder if graph == "encoder" else _check_decoder)(where, p, dims)


def _input_names(graph: str, dims: Dimensions) -> list[str]:
    if graph == "encoder":
        return ["mel"]
    if graph != "decoder":
        raise ProfileError(f"unknown graph {graph!r}: encoder or decoder")
    per_layer = ([f"self_k_{i}", f"self_v_{i}", f"cross_k_{i}", f"cross_v_{i}"] for i in range(dims.n_text_layer))
    return ["tokens", *(name for layer in per_layer for name in layer)]


def _check_range(where: str, r: ShapeRange, allow_zero: tuple[int, ...]) -> None:
    if not len(r.min) == len(r.opt) == len(r.max):
        raise ProfileError(f"{where}: min, opt and max have different ranks")
    for axis, (lo, opt, hi) in enumerate(zip(r.min, r.opt, r.max)):
        if not lo <= opt <= hi:
            raise ProfileError(f"{where}: axis {axis} needs min <= opt <= max, got {lo}, {opt}, {hi}")
        if lo < (0 if axis in allow_zero else 1):
            raise ProfileError(f"{where}: axis {axis} has min {lo}")


def _fixed(where: str, r: ShapeRange, axis: int, value: int) -> None:
    if not r.min[axis] == r.opt[axis] == r.max[axis] == value:
        raise ProfileError(f"{where}: axis {axis} must be exactly {value}")


def _check_encoder(where: str, p: Profile, dims: Dimensions) -> None:
    mel = p.shapes["mel"]
    if len(mel.min) != 3:
        raise ProfileError(f"{where}: mel is [batch, mels, frames]")
    _fixed(where + ", mel", mel, 1, dims.n_mels)
    frames = (mel.min[2], mel.opt[2], mel.max[2])
    if any(f % 2 for f in frames):
        raise ProfileError(f"{where}: mel frames {frames} must be even (the stride-2 convolution halves them)")
    if frames[2] > 2 * dims.n_audio_ctx:
        raise ProfileError(f"{where}: {frames[2]} mel frames exceed the {2 * dims.n_audio_ctx} of 30 s")


def _check_decoder(where: str, p: Profile, dims: Dimensions) -> None:
    heads, hd = dims.n_heads, dims.n_audio_state // dims.n_heads
    tokens = p.shapes["tokens"]
    if len(tokens.min) != 2:
        raise ProfileError(f"{where}: tokens is [batch, n]")
    caches = {p.shapes[k] for k in p.shapes if k.startswith("self_")}
    crosses = {p.shapes[k] for k in p.shapes if k.startswith("cross_")}
    if len(caches) != 1 or len(crosses) != 1:
        raise ProfileError(f"{where}: every layer's self (and every layer's cross) cache needs the same range")
    (cache,), (cross,) = caches, crosses
    for name, r in (("self cache", cache), ("cross cache", cross)):
        if len(r.min) != 4:
            raise ProfileError(f"{where}, {name}: [batch, heads, positions, head_dim]")
        _fixed(f"{where}, {name}", r, 1, heads)
        _fixed(f"{where}, {name}", r, 3, hd)
    # A profile cannot relate two inputs, so it must not admit past + n beyond the position table.
    if cache.max[2] + tokens.max[1] > dims.n_text_ctx:
        raise ProfileError(
            f"{where}: past up to {cache.max[2]} plus {tokens.max[1]} tokens exceeds {dims.n_text_ctx} positions"
        )
    if cross.max[2] > dims.n_audio_ctx:
        raise ProfileError(f"{where}: cross length {cross.max[2]} exceeds the encoder's {dims.n_audio_ctx}")
