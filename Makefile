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

.PHONY: demo test test-versions lint check-dist test-integration install bench docs clean simulate

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

# The simulation of what decides the view (tests/simulation) over more seeds than `make test` runs:
# `make simulate SEEDS=2000`; a failure prints its seed and a shrunk schedule.
SEEDS ?= 500
STEPS ?= 400

simulate: $(STAMP)
	$(BIN)/python -m tests.simulation --seeds $(SEEDS) --steps $(STEPS)

# The range the package claims (setup.cfg: Python 3.10-3.13): a fast subset of the suite under the
# oldest and the newest, each in a venv of its own, from pyenv's builds (`pyenv root`) or pythonX.Y
# on PATH. The subset covers the wire, the tag codec, the store and its ledger, the SQLite source,
# the quarantine and a buffer fed by a real poller process (~1 min each).
OTHER_PYTHONS := 3.10 3.13
FAST_TESTS := tests/test_protocol.py tests/test_packed_merge.py tests/test_ledger.py tests/test_tombstones.py \
	tests/test_quarantine.py tests/test_change_feed.py tests/test_sqlite_source.py tests/test_snapshot_pieces.py \
	tests/test_buffer.py tests/test_verl.py tests/test_public_api.py tests/test_import_graph.py \
	tests/test_config.py tests/test_limits.py tests/test_tq_pickles.py tests/test_peers.py \
	tests/test_data_path.py
PYENV_ROOT ?= $(or $(shell pyenv root 2>/dev/null),$(HOME)/.pyenv)

.venv-%/.installed: setup.cfg pyproject.toml
	@py=$$(ls -d $(PYENV_ROOT)/versions/$*.*/bin/python$* 2>/dev/null | sort -V | tail -n 1); \
	py=$${py:-$$(command -v python$* || true)}; \
	test -n "$$py" || { echo "make: no Python $* (not in pyenv root '$(PYENV_ROOT)', no python$* on PATH)" >&2; exit 1; }; \
	echo "$$py -m venv .venv-$*"; $$py -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet -e '.[dev]'
	touch $@

test-versions: $(foreach v,$(OTHER_PYTHONS),.venv-$(v)/.installed)
	for v in $(OTHER_PYTHONS); do .venv-$$v/bin/python -m pytest -q $(FAST_TESTS) || exit 1; done

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
	rm -rf $(VENV) $(foreach v,$(OTHER_PYTHONS),.venv-$(v)) build *.egg-info site
