# Every target creates the virtual environment on first use, so a fresh clone
# needs nothing but Python 3.10+ and `make`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TQ_STAMP := $(VENV)/.installed-transferqueue
# torch goes in first and stays pinned: pip takes this release's CPU build
# from the machine's local wheel files, where anything else (plain `torch`,
# or a range TransferQueue's dependencies pick) pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint check-dist test-integration install bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(TQ_STAMP): $(STAMP) tests/integration/constraints.txt tests/integration/verl-requirements.txt
	$(BIN)/python -m pip install --quiet '$(TORCH_PIN)'
	$(BIN)/python -m pip install --quiet -c tests/integration/constraints.txt -e '.[dev,transferqueue]' '$(TORCH_PIN)'
	# verl 0.9.1, the differential test's reference: --no-deps, every package pinned in constraints.txt.
	$(BIN)/python -m pip install --quiet --no-deps -c tests/integration/constraints.txt \
		-r tests/integration/verl-requirements.txt
	# verl's wheel also installs its own top-level `tests` package: with its __init__.py it would
	# shadow this repository's tests/ (a namespace package); without it, the two merge, ours first.
	$(BIN)/python -c "import pathlib, sysconfig; \
		pathlib.Path(sysconfig.get_paths()['purelib'], 'tests', '__init__.py').unlink(missing_ok=True)"
	touch $(TQ_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m buffer.demo

test: lint
	$(BIN)/python -m pytest

# Style and types of the two packages (configured in pyproject.toml and setup.cfg).
lint: $(STAMP)
	$(BIN)/python -m ruff check poller buffer
	$(BIN)/python -m mypy

# Build the sdist and wheel, check their contents and metadata, install the wheel
# apart and run a fast subset of the sdist's own tests against it (~30 s).
check-dist: $(STAMP)
	$(BIN)/python .ci/check_dist.py

# The same .venv plus TransferQueue (with Ray and a CPU torch) and verl 0.9.1: a real
# local store, the buffer on the TransferQueue source, the verl-style example, and
# buffer.verl compared decision by decision with verl's own sampler.
test-integration: $(TQ_STAMP)
	$(BIN)/python -m pytest -m integration tests/integration

# The benchmarks (docs/benchmarks.md); matplotlib draws the plots. `--only tq` runs on a real
# TransferQueue beside verl 0.9.1's sampler: the integration install first (several minutes, once),
# then matplotlib under the same constraints, so it cannot move numpy or torch.
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(TQ_STAMP)
	$(BIN)/python -m pip install --quiet -c tests/integration/constraints.txt -e '.[dev,transferqueue,bench]' '$(TORCH_PIN)'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench

# The manual (docs/, mkdocs.yml) into site/: --strict fails on a broken link, a missing page or
# a missing API reference; then .ci/check_docs.py renders the index, API and verl pages in
# headless Chromium (Debian's `chromium`; .ci/run installs it) and checks what they show.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet
	$(BIN)/python .ci/check_docs.py

clean:
	rm -rf $(VENV) build *.egg-info site
