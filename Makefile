# The two commands of the README: `make run` and `make test`. Each installs what it needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: install
	$(VENV)/bin/streamserver transcribe tests/data/librivox/librivox_0870.wav

test: install
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
