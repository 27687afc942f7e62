# The two set-up commands (see README): `make demo` and `make test`.
# Each builds its own virtual environment in .venv and installs everything it needs.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VERL_STAMP := $(VENV)/.verl-installed
TITAN_STAMP := $(VENV)/.titan-installed
PARALLEL_TESTS := tests/flashkda tests/model tests/plan
APT_PACKAGES := iproute2 bubblewrap util-linux procps python3 nftables chromium e2fsprogs

.PHONY: demo test install apt lint clean

apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "apt-get install:$$missing"; \
		apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 is a CPU build on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	@touch $(STAMP)

# verl for its agent-loop adapter test only, without its requirement list (see requirements/verl-test.txt).
$(VERL_STAMP): requirements/verl-test.txt $(STAMP)
	$(PY) -m pip install -q --no-deps -r requirements/verl-test.txt
	@touch $(VERL_STAMP)

# torchtitan for the K3 registration test, pinned without its requirement list (see requirements/titan-test.txt).
$(TITAN_STAMP): requirements/titan-test.txt $(STAMP)
	$(PY) -m pip install -q --no-deps -r requirements/titan-test.txt
	@touch $(TITAN_STAMP)

install: apt $(STAMP)

demo: install
	$(VENV)/bin/k3infra demo

test: install $(VERL_STAMP) $(TITAN_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	@# single-process compute tests on two workers (pytest-xdist), one thread each so that the workers do not
	@# oversubscribe the two cores, then the rest (multi-process, sandboxes, timing) alone
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
	$(PY) -m pytest -q -m "not gpu" -p no:cacheprovider --durations=10 -n 2 $(PARALLEL_TESTS); first=$$?; \
	$(PY) -m pytest -q -m "not gpu" -p no:cacheprovider --durations=25 $(PARALLEL_TESTS:%=--ignore=%); \
	rest=$$?; [ $$first -eq 0 ] && [ $$rest -eq 0 ]

clean:
	rm -rf $(VENV) build src/*.egg-info
