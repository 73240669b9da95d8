#!/bin/sh
# Build an image unless one built from the same inputs is there already; print its name.
#   docker/build-image.sh [DOCKERFILE [NAME]]     (default docker/Dockerfile, streamserver)
# The image is tagged NAME:<hash of its inputs> and NAME:latest. The inputs are what the build
# context lets in (.dockerignore) and the Dockerfile, as they are on disk (tracked or not, less
# what git ignores): a tree that did not change reuses its image, one that did (or a machine that
# never built it, such as a clean CI machine) builds it. NAME:<hash> tags older than the one
# before are removed.
# Docker when its daemon answers, else podman (CONTAINER_ENGINE=docker|podman to choose); with
# podman, the build uses the host's network and its CA bundle (PIP_CERT, docker/README.md).
set -eu
cd "$(dirname "$0")/.."
DOCKERFILE=${1:-docker/Dockerfile}
NAME=${2:-streamserver}

if [ -n "${CONTAINER_ENGINE:-}" ]; then
	engine=$CONTAINER_ENGINE
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
	engine=docker
elif command -v podman >/dev/null; then
	engine=podman
else
	echo "build-image: neither a running docker nor podman (make container-runtime installs podman)" >&2
	exit 1
fi

inputs="pyproject.toml constraints.txt README.md LICENSE streamserver engines docker/healthcheck.py .dockerignore $DOCKERFILE"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
	files=$(git ls-files --cached --others --exclude-standard -- $inputs | sort -u)
else
	files=$(find $inputs -type f ! -path '*/__pycache__/*' ! -name '*.pyc' | sort)
fi
hash=$(for f in $files; do [ -f "$f" ] && printf '%s  %s\n' "$(sha256sum < "$f" | cut -c1-64)" "$f"; done |
	sha256sum | cut -c1-16)
image="$NAME:$hash"

if $engine image inspect "$image" >/dev/null 2>&1; then
	echo "build-image: $image is built from these inputs already" >&2
else
	set -- --file "$DOCKERFILE" --tag "$image" --label "org.opencontainers.image.title=$NAME"
	if [ "$engine" = podman ]; then
		# docker format: the OCI format has no HEALTHCHECK
		set -- "$@" --format docker --network host
		ca=/etc/ssl/certs/ca-certificates.crt
		[ -f "$ca" ] && set -- "$@" --volume "$ca:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt
	fi
	start=$(date +%s)
	$engine build "$@" . >&2
	echo "build-image: built $image in $(($(date +%s) - start)) s" >&2
	# Keep this build and the one before (a test run of the previous tree may still use it).
	for old in $($engine images --format '{{.CreatedAt}}|{{.Repository}}:{{.Tag}}' | sort -r | cut -d'|' -f2 |
		grep -E "(^|/)$NAME:[0-9a-f]{16}\$" | grep -v ":$hash\$" | tail -n +2); do
		$engine rmi "$old" >/dev/null 2>&1 || true
	done
	$engine image prune -f >/dev/null 2>&1 || true
fi
$engine tag "$image" "$NAME:latest"
echo "$image"
