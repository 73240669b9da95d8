"""The GPU engine (torch-cuda) against Hugging Face transformers eager on the same weights, one
command on a CUDA machine; plus the in-flight batcher under Poisson arrivals, and its transcripts
against the CPU backend's.

Two steps, because the GPU machine has neither PyAV nor ONNX Runtime's graphs built:
    # here, on the CPU: clips as arrays + the CPU backend's transcripts of them
    .venv/bin/python -m benchmarks.gpu_bench prepare --out DIR
    # there, on the GPU
    python -m benchmarks.gpu_bench run --prepared DIR --out benchmarks/results/gpu-h200.json

Rows: per model, backend and batch size (1, 16, 64, 128) the wall time of a whole batch from
float32 audio to text (log-mel, encoder, decoding, detokenising; the engine's voicing gate
included for torch-cuda), p50 and p99 over repeats, utterances/s = batch / p50. Real utterances
of 1.8-7.1 s (the dev clips, repeated to fill a batch). transformers needs 30 s inputs, so its
features are padded to 3000 frames, as it requires. The in-flight sweep submits utterances at
Poisson arrival times and reports, per rate, the latency from arrival to finished tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

MODELS = ("base", "tiny.en")
BATCHES = (1, 16, 64, 128)
RATES = (500, 1000, 1500, 2000, 2500, 3000, 4000, 6000)
P99_BOUND_MS = 100.0
ADMIT_BATCH = 64  # in-flight arrivals encoded together ...
ADMIT_WAIT_S = 0.010  # ... or once the oldest has waited this long


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- prepare (CPU machine)


def transcripts(engine: Any, clips: dict[str, np.ndarray], languages: dict[str, str]) -> dict[str, str]:
    """Text of every clip the model can take (English-only models: the English ones), one batch
    per language: the same call on the CPU reference and on the GPU."""
    names = [n for n in clips if engine.multilingual or languages[n] == "en"]
    texts: dict[str, str] = {}
    for lang in ("en", "zh"):
        batch = [n for n in names if languages[n] == lang]
        if batch:
            texts.update({n: t.text for n, t in zip(batch, engine.transcribe_batch([clips[n] for n in batch], lang))})
    return texts


def prepare(out: Path, clip_dirs: list[Path]) -> None:
    from engines.audio import load_audio
    from engines.loading import load_engine

    out.mkdir(parents=True, exist_ok=True)
    clips: dict[str, np.ndarray] = {}
    languages: dict[str, str] = {}
    for folder in clip_dirs:
        for wav in sorted(folder.glob("*.wav")):
            name = f"{folder.name}/{wav.stem}"
            clips[name] = load_audio(wav)
            languages[name] = "zh" if folder.name.startswith("zh") else "en"
    np.savez(out / "clips.npz", **{k.replace("/", "__"): v for k, v in clips.items()})
    reference: dict[str, Any] = {"languages": languages}
    for model in MODELS:
        for precision in ("fp32", "int8"):
            texts = transcripts(load_engine(model, precision=precision), clips, languages)
            reference[f"{model}/{precision}"] = texts
            _log(f"CPU reference {model} {precision}: {len(texts)} clips")
    (out / "cpu-reference.json").write_text(json.dumps(reference, ensure_ascii=False, indent=1))


# ---------------------------------------------------------------- run (GPU machine)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        result = fn()
        _sync()
        times.append((time.perf_counter() - start) * 1000)
    return times, result


def _row(model: str, backend: str, batch: int, audios: list[np.ndarray], times: list[float]) -> dict[str, Any]:
    p50 = float(np.percentile(times, 50))
    return {
        "model": model, "backend": backend, "batch": batch,
        "audio_s": round(float(np.mean([a.size / 16000 for a in audios])), 2),
        "p50_ms": round(p50, 2), "p99_ms": round(float(np.percentile(times, 99)), 2),
        "utt_per_s": round(batch / p50 * 1000, 1), "repeats": len(times),
    }


def hf_model(model: str, device: Any) -> tuple[Any, Callable[[list[np.ndarray]], list[list[int]]]]:
    """transformers' WhisperForConditionalGeneration with our weights (eager attention, fp16), and
    a function from audio to generated token ids."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    from engines.engine import token_budget
    from engines.tokenizer import WhisperTokenizer
    from engines.gpu.model import GpuLogMel
    from engines.weights import load_weights

    w = load_weights(model)
    d, t = w.dims, w.tensors
    tok = WhisperTokenizer.load(w.folder, w.config, d.n_vocab)
    cfg = WhisperConfig(
        vocab_size=d.n_vocab, num_mel_bins=d.n_mels, d_model=d.n_audio_state,
        encoder_layers=d.n_audio_layer, decoder_layers=d.n_text_layer,
        encoder_attention_heads=d.n_heads, decoder_attention_heads=d.n_heads,
        encoder_ffn_dim=4 * d.n_audio_state, decoder_ffn_dim=4 * d.n_audio_state,
        max_source_positions=d.n_audio_ctx, max_target_positions=d.n_text_ctx,
        bos_token_id=tok.eot, eos_token_id=tok.eot, pad_token_id=tok.eot, decoder_start_token_id=tok.sot,
        activation_function="gelu", scale_embedding=False, tie_word_embeddings=True,
    )
    hf = WhisperForConditionalGeneration._from_config(cfg, attn_implementation="eager")
    width = d.n_audio_state
    sd: dict[str, Any] = {}

    def put(name: str, array: np.ndarray) -> None:
        sd[name] = torch.from_numpy(np.ascontiguousarray(array, np.float32))

    def attention(src: str, dst: str, fused: bool) -> None:
        wq = t[src + "/linear_0/weight"]
        bq = t[src + "/linear_0/bias"]
        if fused:  # self-attention: q, k, v rows in one matrix
            for j, name in enumerate("qkv"):
                put(f"{dst}.{name}_proj.weight", wq[j * width : (j + 1) * width])
                if name != "k":
                    put(f"{dst}.{name}_proj.bias", bq[j * width : (j + 1) * width])
            put(dst + ".out_proj.weight", t[src + "/linear_1/weight"])
            put(dst + ".out_proj.bias", t[src + "/linear_1/bias"])
        else:  # cross-attention: q, then k and v in one matrix, then the output
            put(dst + ".q_proj.weight", wq)
            put(dst + ".q_proj.bias", bq)
            kv, kvb = t[src + "/linear_1/weight"], t[src + "/linear_1/bias"]
            put(dst + ".k_proj.weight", kv[:width])
            put(dst + ".v_proj.weight", kv[width:])
            put(dst + ".v_proj.bias", kvb[width:])
            put(dst + ".out_proj.weight", t[src + "/linear_2/weight"])
            put(dst + ".out_proj.bias", t[src + "/linear_2/bias"])

    def norm(src: str, dst: str) -> None:
        put(dst + ".weight", t[src + "/gamma"])
        put(dst + ".bias", t[src + "/beta"])

    for i in (1, 2):
        put(f"model.encoder.conv{i}.weight", t[f"encoder/conv{i}/weight"])
        put(f"model.encoder.conv{i}.bias", t[f"encoder/conv{i}/bias"])
    put("model.encoder.embed_positions.weight", t["encoder/position_encodings/encodings"])
    for side, n in (("encoder", d.n_audio_layer), ("decoder", d.n_text_layer)):
        for i in range(n):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            norm(src + "/self_attention/layer_norm", dst + ".self_attn_layer_norm")
            attention(src + "/self_attention", dst + ".self_attn", True)
            norm(src + "/ffn/layer_norm", dst + ".final_layer_norm")
            for j, fc in ((0, "fc1"), (1, "fc2")):
                put(f"{dst}.{fc}.weight", t[f"{src}/ffn/linear_{j}/weight"])
                put(f"{dst}.{fc}.bias", t[f"{src}/ffn/linear_{j}/bias"])
            if side == "decoder":
                norm(src + "/attention/layer_norm", dst + ".encoder_attn_layer_norm")
                attention(src + "/attention", dst + ".encoder_attn", False)
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
    put("model.decoder.embed_tokens.weight", t["decoder/embeddings/weight"])
    put("model.decoder.embed_positions.weight", t["decoder/position_encodings/encodings"])
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "proj_out.weight"]  # tied to the token embedding
    if missing or unexpected:
        raise RuntimeError(f"weights did not map: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.tie_weights()
    hf = hf.to(device, torch.float16).eval()
    gen = GenerationConfig(
        decoder_start_token_id=tok.sot, eos_token_id=tok.eot, pad_token_id=tok.eot, bos_token_id=tok.eot,
        suppress_tokens=sorted(tok.suppress_ids), begin_suppress_tokens=sorted(tok.suppress_ids_begin),
        no_timestamps_token_id=tok.special("<|notimestamps|>"), return_timestamps=False,
        is_multilingual=tok.multilingual,
    )
    if tok.multilingual:
        gen.lang_to_id = {f"<|{code}|>": i for code, i in tok.languages.items()}
        gen.task_to_id = {"transcribe": tok.special("<|transcribe|>"), "translate": tok.special("<|translate|>")}
    hf.generation_config = gen
    mel = GpuLogMel(device, d.n_mels)
    extra = {"language": "en", "task": "transcribe"} if tok.multilingual else {}

    @torch.inference_mode()
    def transcribe(audios: list[np.ndarray]) -> list[list[int]]:
        features = mel(audios, 3000, None).to(torch.float16)  # transformers requires 30 s
        budget = max(token_budget(a.size) for a in audios)
        out = hf.generate(input_features=features, max_new_tokens=budget, do_sample=False, num_beams=1, **extra)
        sequences = out.sequences if hasattr(out, "sequences") else out
        return [[int(x) for x in row if int(x) < tok.eot] for row in sequences.tolist()]

    return hf, transcribe


class Report:
    """The results JSON, rewritten after every measurement so that a cut-off run keeps what it did."""

    def __init__(self, path: Path, head: dict[str, Any]) -> None:
        self.path, self.data = path, {**head, "rows": [], "inflight": None, "equality": {}, "errors": []}
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, ensure_ascii=False, indent=1))

    def guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - record, go on with the rest
            _log(f"FAILED {what}: {error!r}")
            self.data["errors"].append({"what": what, "error": repr(error), "trace": traceback.format_exc()[-3000:]})
            self.save()
            return None


def inflight_sweep(
    engine: Any, audios: list[np.ndarray], rates: tuple[int, ...], seconds: float, warm_rate: int = 2000
) -> list[dict[str, Any]]:
    """Poisson arrivals at each rate for `seconds`; latency = arrival -> tokens done. Arrivals that
    came while the GPU was busy are encoded together at the next step boundary."""
    out = []
    rng = np.random.default_rng(0)
    frames = engine.policy.frames(max(a.size for a in audios))
    languages = ["en"] * len(audios)
    templates = engine.jobs(audios, languages, None)
    prefix = engine.prefix_for("en", None)
    for size in (1, 2, 4, 8, 16, 32, 64):  # capture every encoder bucket before the clock runs
        engine.encode([audios[i % len(audios)] for i in range(size)], frames, prefix)
    # One unmeasured second at a high rate first: the first admission of each batch size builds
    # its cuFFT and cuBLAS plans once, as it would in the first seconds of a server's life.
    for rate, measured in [(warm_rate, False)] + [(r, True) for r in rates]:
        n = int(rate * (seconds if measured else 1.0))
        arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
        picks = rng.integers(0, len(audios), n)
        finished_at = np.zeros(n)
        nxt, done = 0, 0
        dec = engine.decoder
        max_active = 0
        longest, previous = 0.0, 0.0  # the longest host iteration: a stall shows here
        _sync()
        t0 = time.perf_counter()
        while done < n:
            now = time.perf_counter() - t0
            longest, previous = max(longest, now - previous), now
            last = int(np.searchsorted(arrivals, now, side="right"))
            waiting = last - nxt
            # Arrivals are encoded together: when enough wait, when the oldest has waited
            # ADMIT_WAIT_S, or at once when the decoder is idle. One encoder call per arrival
            # would cost more than the decode steps it interleaves with.
            if waiting and (waiting >= ADMIT_BATCH or now - arrivals[nxt] >= ADMIT_WAIT_S or not dec.busy):
                # At most ADMIT_BATCH at once: larger groups leave the captured encoder graphs for
                # eager passes whose every new row count meets cuDNN's benchmark and a new cuFFT plan.
                last = min(last, nxt + ADMIT_BATCH)
                idx = list(range(nxt, last))
                nxt = last
                jobs = [replace(templates[picks[i]], tag=i, result=None) for i in idx]
                cross_kv, ready, prefilled = engine.encode([audios[picks[i]] for i in idx], frames, prefix)
                dec.submit(cross_kv, jobs, ready, prefilled)
            if not dec.busy:
                if nxt < n:
                    time.sleep(max(0.0, min(arrivals[nxt] - now, 0.001)))
                continue
            for job in dec.run_once():
                finished_at[job.tag] = time.perf_counter() - t0
                done += 1
            max_active = max(max_active, dec.active)
        lat = (finished_at - arrivals) * 1000
        row = {
            "rate_utt_s": rate, "utterances": n, "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2), "max_ms": round(float(lat.max()), 2),
            "achieved_utt_s": round(float(n / finished_at.max()), 1), "max_active_slots": max_active,
            "longest_iteration_ms": round(longest * 1000, 2),
        }
        if not measured:
            _log(f"in-flight warm-up {row}")
            continue
        _log(f"in-flight {row}")
        out.append(row)
        if row["p99_ms"] > 4 * P99_BOUND_MS and len(out) > 1 and out[-2]["p99_ms"] > P99_BOUND_MS:
            break  # two rates past the bound: higher rates only queue longer
    return out


def phases(engine: Any, audios: list[np.ndarray], language: str, trace: Path | None) -> dict[str, Any]:
    """Where one batch's time goes: each phase of transcribe_batch run on its own and waited for
    (so the sum is a little over the pipelined whole), the decoder's step count, and with `trace`
    a kernel table of the whole batch from torch.profiler (kernels inside CUDA graphs included)."""
    import torch

    from engines.engine import MIN_VOICED_SECONDS
    from engines.voicing import has_voicing

    def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
        _sync()
        start = time.perf_counter()
        value = fn()
        _sync()
        return round((time.perf_counter() - start) * 1000, 2), value

    out: dict[str, Any] = {"batch": len(audios)}
    frames = engine.policy.frames(max(a.size for a in audios))
    engine.transcribe_batch(audios, language)  # first calls of these shapes: captures, plans
    mel = engine.mel(audios, frames, engine.policy.pad_value)
    prefix = engine.prefix_for(language, None)
    tokens, sot = tuple(prefix[0]), prefix[1]
    if engine.whisper.device.type == "cuda" and len(audios) <= 64:
        engine._encode_graph(mel, tokens, sot)
    out["voicing_ms"], _ = clock(lambda: [has_voicing(a, MIN_VOICED_SECONDS) for a in audios])
    out["log_mel_ms"], mel = clock(lambda: engine.mel(audios, frames, engine.policy.pad_value))
    graphed = engine.whisper.device.type == "cuda" and len(audios) <= 64
    encoder = getattr(engine, "_encoder", engine.whisper.encode)  # compiled where the engine compiles it
    out["encoder_and_prefill_ms"], _ = clock(lambda: engine._encode_graph(mel, tokens, sot) if graphed else encoder(mel))
    out["log_mel_encoder_prefill_ms"], (cross_kv, ready, prefilled) = clock(lambda: engine.encode(audios, frames, prefix))
    jobs = engine.jobs(audios, [language] * len(audios), None)
    dec = engine.decoder
    steps = 0

    def decode() -> None:
        nonlocal steps
        dec.submit(cross_kv, jobs, ready, prefilled)
        waiting = {id(j) for j in jobs}
        while waiting:
            steps += 1
            for job in dec.run_once():
                waiting.discard(id(job))

    out["decode_ms"], _ = clock(decode)
    out["steps"] = steps
    # The step's own GPU time (its graph replayed back to back, every slot finished and masked):
    # decode_ms / steps above it is what the host loop, admission and the prefill add.
    key = next((k for k in dec._graphs if k[0] >= len(audios)), None)
    if key is not None:
        graph = dec._graphs[key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        _sync()
        out["step_graph"] = {"bucket": list(key), "ms": round(start.elapsed_time(end) / 50, 3)}
    out["finish_ms"], _ = clock(lambda: [engine._finish(j.result, frames) for j in jobs])
    out["total_ms"], _ = clock(lambda: engine.transcribe_batch(audios, language))
    if trace is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.transcribe_batch(audios, language)
            _sync()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels"] = sum(e.count for e in kernels)
        out["kernel_ms"] = round(sum(e.self_device_time_total for e in kernels) / 1000, 2)
        trace.write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90))
    _log(f"phases {out}")
    return out


def run(
    prepared: Path, out_path: Path, models: list[str], repeats: int, sweep_seconds: float,
    device_name: str = "cuda", slots: int = 256, batches: tuple[int, ...] = BATCHES, rates: tuple[int, ...] = RATES,
    labels: dict[str, str] | None = None,
) -> None:
    """`labels`: model folders (random weights: speed only) -> the name their rows carry; they
    have no CPU reference to be compared with, and get the in-flight sweep as base does."""
    labels = labels or {}
    import torch

    from engines.gpu.engine import TorchCudaEngine

    device = torch.device(device_name)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    report = Report(out_path, {"commit": commit, "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "none (cpu)", "torch": torch.__version__})
    archive = np.load(prepared / "clips.npz")
    clips = {k.replace("__", "/"): archive[k] for k in archive.files}
    reference = json.loads((prepared / "cpu-reference.json").read_text())
    languages = reference["languages"]
    english = [n for n in clips if languages[n] == "en"]
    three = min(english, key=lambda n: abs(clips[n].size / 16000 - 3.0))

    for model in models:
        _log(f"loading {model}")
        engine = TorchCudaEngine.of_model(model, device=device, slots=slots)
        tok = engine.tokenizer
        started = time.perf_counter()
        engine.warmup()
        report.data.setdefault("warmup", {})[model] = {
            "seconds": round(time.perf_counter() - started, 1), "compiled_step": engine.decoder.compiled,
        }
        report.save()
        _log(f"{model} warm-up {report.data['warmup'][model]}")
        report.guard(f"{model} capture", lambda: engine.decoder.capture(engine.policy.frames(16000 * 8) // 2))

        def equality() -> None:
            got = transcripts(engine, clips, languages)
            names = list(got)
            alone = {n: engine.transcribe_batch([clips[n]], languages[n])[0].text for n in names}
            result = {"clips": len(names), "batched_equals_alone": sum(got[n] == alone[n] for n in names)}
            for precision in ("fp32", "int8"):
                ref = reference[f"{model}/{precision}"]
                result[f"equal_to_cpu_{precision}"] = sum(got[n] == ref[n] for n in names)
                result[f"differences_vs_cpu_{precision}"] = [{"clip": n, "gpu": got[n], "cpu": ref[n]} for n in names if got[n] != ref[n]]
            report.data["equality"][model] = result
            report.save()
            _log(f"{model} equality: {json.dumps({k: v for k, v in result.items() if not k.startswith('diff')})}")

        if model not in labels:
            report.guard(f"{model} equality", equality)

        for batch in (1, 64):
            audios = [clips[three]] if batch == 1 else [clips[english[i % len(english)]] for i in range(batch)]
            trace = out_path.parent / f"kernels-{Path(model).name}-b{batch}.txt"
            report.data.setdefault("phases", {}).setdefault(model, {})[str(batch)] = report.guard(
                f"{model} phases {batch}", lambda: phases(engine, audios, "en", trace))
            report.save()

        for batch in batches:
            audios = [clips[three]] if batch == 1 else [clips[english[i % len(english)]] for i in range(batch)]

            def torch_row() -> None:
                times, _ = _timed(lambda: engine.transcribe_batch(audios, "en"), repeats if batch <= 16 else max(5, repeats // 4))
                row = _row(labels.get(model, model), "torch-cuda", batch, audios, times)
                report.data["rows"].append(row)
                report.save()
                _log(str(row))

            report.guard(f"{model} torch-cuda batch {batch}", torch_row)

        if model == "base" or model in labels:
            sweep = report.guard("in-flight sweep", lambda: inflight_sweep(engine, [clips[n] for n in english], rates, sweep_seconds))
            if sweep:
                ok = [r for r in sweep if r["p99_ms"] <= P99_BOUND_MS]
                best = max(ok, key=lambda r: r["rate_utt_s"]) if ok else None
                report.data["inflight" if model == "base" else f"inflight {labels[model]}"] = {
                    "model": labels.get(model, model), "max_rate_utt_s": best["rate_utt_s"] if best else 0,
                    "p99_ms": best["p99_ms"] if best else None, "sweep": sweep, "seconds_per_rate": sweep_seconds,
                }
                report.save()

        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()

        def hf_rows() -> None:
            hf, transcribe = hf_model(model, device)
            transcribe([clips[three]])  # warm-up
            sample = {n: tok.decode(ids).strip() for n, ids in zip(english[:4], transcribe([clips[n] for n in english[:4]]))}
            report.data.setdefault("hf_sample", {})[model] = sample
            for batch in batches:
                audios = [clips[three]] if batch == 1 else [clips[english[i % len(english)]] for i in range(batch)]
                times, _ = _timed(lambda: transcribe(audios), 5 if batch <= 16 else 3)
                row = _row(labels.get(model, model), "hf-eager", batch, audios, times)
                report.data["rows"].append(row)
                report.save()
                _log(str(row))
            del hf
            if device.type == "cuda":
                torch.cuda.empty_cache()

        report.guard(f"{model} hf-eager", hf_rows)
    _log(f"done -> {out_path}")


def markdown(results: dict[str, Any]) -> str:
    lines = ["| model | backend | batch | audio s | p50 ms | p99 ms | utt/s |", "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {r['backend']} | {r['batch']} | {r['audio_s']} | {r['p50_ms']} | {r['p99_ms']} | {r['utt_per_s']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--clips", type=Path, nargs="+", default=[Path("../shared/data/en_dev"), Path("../shared/data/zh_dev")])
    r = sub.add_parser("run")
    r.add_argument("--prepared", type=Path, required=True)
    r.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-h200.json"))
    r.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS, help="packaged models (none: only --turbo-template)")
    r.add_argument("--turbo-template", type=Path, metavar="DIR",
                   help="also a folder with large-v3-turbo's geometry (1280 wide, 32 + 4 layers, 128 mels, 51,866 "
                        "tokens) and random weights, written from this tests.synthetic_model.export_template() folder: "
                        "speed only; its rows say so")
    r.add_argument("--repeats", type=int, default=20)
    r.add_argument("--sweep-seconds", type=float, default=2.0)
    r.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    r.add_argument("--slots", type=int, default=256)
    r.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    r.add_argument("--rates", type=int, nargs="+", default=list(RATES))
    m = sub.add_parser("markdown")
    m.add_argument("results", type=Path)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.clips)
    elif args.command == "run":
        models, labels = list(args.models), {}
        if args.turbo_template:
            from tests.synthetic_model import TURBO, write_turbo_like

            _log("writing the large-v3-turbo-geometry folder (random weights)")
            folder = str(write_turbo_like(Path("/tmp/large-v3-turbo-geometry"), **TURBO, template=args.turbo_template))
            models.append(folder)
            labels[folder] = "large-v3-turbo geometry (random weights)"
        run(args.prepared, args.out, models, args.repeats, args.sweep_seconds, args.device, args.slots,
            tuple(args.batches), tuple(args.rates), labels)
    else:
        print(markdown(json.loads(args.results.read_text())))


if __name__ == "__main__":
    main()
