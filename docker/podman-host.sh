#!/bin/sh
# Make this machine able to build and run the images with Debian's podman when it has no Docker
# daemon and no image registry (this workplace, its CI): install podman, runc and debootstrap (and
# Debian's docker-compose v1, which checks a compose file against the compose schema without a
# daemon; podman-compose, which runs the stack, comes with the dev extra) when root and apt are
# there, configure podman as these machines need, and bootstrap the base image from the apt mirror
# when it cannot be pulled. Each step is skipped when already done; a machine with a working
# Docker needs none of it. Exit 1 when podman is not there at the end (the caller says why).
set -eu

BASE=docker.io/library/debian:bookworm-slim
apt_install() {
	[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 ||
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }
}

if ! command -v podman >/dev/null || ! command -v docker-compose >/dev/null; then
	apt_install podman runc debootstrap docker-compose || true
fi
command -v podman >/dev/null || { echo "podman-host: podman is not installed and cannot be (needs root and apt)" >&2; exit 1; }

# podman's defaults fail on these machines: crun refuses the hybrid cgroup layout and setrlimit is
# not permitted. Written only where no containers.conf is, so a configured host is left alone.
if [ "$(id -u)" = 0 ] && [ ! -e /etc/containers/containers.conf ]; then
	printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' \
		> /etc/containers/containers.conf
fi

if ! podman image exists "$BASE"; then
	# A registry first (timeout: here the pull would wait on a network that never answers) ...
	timeout 60 podman pull -q "$BASE" >/dev/null 2>&1 || true
fi
if ! podman image exists "$BASE"; then
	# ... else the same Debian release from the mirror apt uses, under the name the Dockerfile pulls.
	command -v debootstrap >/dev/null || apt_install debootstrap ||
		{ echo "podman-host: $BASE cannot be pulled and debootstrap is missing" >&2; exit 1; }
	mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
	[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list 2>/dev/null)
	rootfs=$(mktemp -d)
	debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null
	rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
	tar -C "$rootfs" -c . | podman import -q - "$BASE" >/dev/null
	rm -rf "$rootfs"
	echo "podman-host: $BASE bootstrapped from $mirror" >&2
fi
