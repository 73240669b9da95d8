# The two commands of the README: `make run` and `make test`. Each installs what it needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test clean system-packages container-runtime image image-gpu constraints

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The main job: the classroom server with a demo room; open the printed teacher and student URLs.
run: install
	$(VENV)/bin/streamserver serve --demo-room "Demo class" $(SERVE_ARGS)

# The browser tests drive Debian's Chromium (never a downloaded browser), the uplink tests a
# redis-server built with TLS (Debian's), the network blip test iptables; install them when
# missing and we may (root, apt); otherwise those tests skip and say why, or fail under CI=true
# (tests/system_packages.py).
system-packages:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
		echo "note: chromium not installed; browser tests will be skipped"
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null || \
		 (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)) ; } || \
		echo "note: redis-server not installed; the TLS Redis tests will be skipped"
	@command -v turnserver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq coturn >/dev/null || \
		 (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq coturn >/dev/null)) ; } || \
		echo "note: coturn not installed; the TURN test will be skipped"
	@command -v iptables >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null || \
		 (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null)) ; } || \
		echo "note: iptables not installed; the network blip test will be skipped"

# The container tests (tests/test_container.py) build and run the images: with Docker when its
# daemon answers, else with Debian's podman, installed and set up here when root and apt are there
# (docker/podman-host.sh: podman, runc, debootstrap, the debian:bookworm-slim base image).
container-runtime:
	@docker info >/dev/null 2>&1 || sh docker/podman-host.sh || \
		echo "note: no docker daemon and podman cannot be installed; the container tests will be skipped"

# The CPU image (docker/Dockerfile), tagged streamserver:latest; rebuilt only when its inputs changed.
image: container-runtime
	docker/build-image.sh

# The GPU worker image (docker/Dockerfile.gpu, torch with its CUDA runtime: several GB).
image-gpu: container-runtime
	docker/build-image.sh docker/Dockerfile.gpu streamserver-gpu

# -rs: each skipped test's reason (a missing package, no GPU) in the summary; --durations: the
# slowest tests, as CI must finish within 30 minutes on 2 cores.
test: install system-packages container-runtime
	$(VENV)/bin/python -m pytest -q -rs --durations=60

# Every version an install gets (constraints.txt), from this venv after `make test` passed in it;
# after changing a range in pyproject.toml: pip install the new versions, `make test`, then this.
constraints:
	$(VENV)/bin/python tools/constraints.py

clean:
	rm -rf $(VENV) build *.egg-info
