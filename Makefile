# `make demo` and `make test` set everything up on a fresh machine: they create .venv when it is
# missing and reinstall only when pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# checkov pins an old boto3: it gets a virtualenv of its own (infra/checkov.sh creates it)
CHECKOV := .venv-checkov/bin/checkov

.PHONY: demo test test-fast bench install checkov browser containers

install: $(STAMP)

# uv (from PyPI) installs the same packages as pip, in parallel: 48 s against pip's 1m53s on this machine, their
# bytecode compiled as pip does (every process imports torch: 2.3 s of CPU compiled, 5.5 s not, where
# PYTHONDONTWRITEBYTECODE is set); pip does it where uv cannot be had. uv does not read PIP_FIND_LINKS (where
# this machine keeps its local torch wheel): it is passed on. pip is upgraded all the same: jobs' requirements use it
EXTRAS := dev,hf,peft,kernels,fp8,report,tensorboard,kubernetes
FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0, the local CPU wheel; any other spec pulls several GB of CUDA packages
	($(PY) -m pip install --quiet --upgrade pip uv && \
	  $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode $(FIND_LINKS) 'torch==2.13.0' -e '.[$(EXTRAS)]') || \
	 ($(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet 'torch==2.13.0' && \
	  $(PY) -m pip install --quiet -e '.[$(EXTRAS)]')
	# pip compiles what it installs but not an editable project: without this every process of a job (each rank,
	# driver and supervisor) compiles trainyard's sources again where PYTHONDONTWRITEBYTECODE is set (0.3 s a rank)
	$(PY) -m compileall -q trainyard tests
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# without a package index the checkov virtualenv cannot be made; tests/infra then says so and skips
$(CHECKOV):
	-PYTHON=$(PYTHON) infra/checkov.sh --install-only

# the report's browser test (tests/sdk/test_report.py) needs chromium; best effort (root with apt-get), never
# failing the build: without it that test says so and skips
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  (command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	   (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium))) || true

# the image tests (tests/image) build the CPU image and run jobs in it: podman (with runc: crun 1.8 refuses hybrid
# cgroup v1/v2 hosts), buildah and mmdebstrap, from Debian's packages; best effort as for the browser: without
# them those tests say so and skip
CONTAINER_TOOLS := podman buildah mmdebstrap runc
containers:
	@missing=""; for t in $(CONTAINER_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	  [ -z "$$missing" ] || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	    (apt-get install -y -q $$missing || \
	     (apt-get update -q && apt-get install -y -q $$missing)); } || \
	  echo "make containers: could not install$$missing (needs root and apt-get); the image tests will skip"

# The fast cases on 2 workers (pytest-xdist: 3m55s -> 2m26s on this 2-core machine), then the slow multi-process
# jobs one at a time (on 2 cores they would only slow each other; nor do the fast cases gain from running beside
# them: docs/test-durations.md). --durations: the slowest cases in every run's log, to keep the suite within its
# 25-minute budget (docs/test-durations.md)
test: $(STAMP) $(CHECKOV) browser containers
	$(PY) -m pytest -m 'not slow' -n 2 --durations=10
	@# the CPU image the image tests run, built in the background (niced, in a session of its own: ended with the
	@# cases) while the first slow cases run: its I/O waits overlap theirs (built beside the fast cases, which keep
	@# both cores busy, it cost them ~30 s), and the tests' fixture waits for it (builds of one checkout take turns)
	@pid=; if command -v mmdebstrap >/dev/null && { command -v podman || command -v buildah; } >/dev/null; then \
	  setsid nice -n 10 $(VENV)/bin/trainyard image build --variant cpu --context . > $(VENV)/image-build.log 2>&1 & \
	  pid=$$!; fi; \
	echo "$(PY) -m pytest -m slow --durations=25"; $(PY) -m pytest -m slow --durations=25; rc=$$?; \
	[ -z "$$pid" ] || kill -- -$$pid $$pid 2>/dev/null; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -m 'not slow'

checkov:
	PYTHON=$(PYTHON) infra/checkov.sh

bench: $(STAMP)
	$(PY) bench/startup.py --json bench/results/startup.json
	$(PY) bench/mics.py --json bench/results/mics.json
	$(PY) bench/pipeline.py --json bench/results/pipeline.json
	$(PY) bench/parallel3d.py --json bench/results/parallel3d.json
	$(PY) bench/checkpoint.py --json bench/results/checkpoint.json
	$(PY) bench/engine_api.py --json bench/results/engine_api.json
	$(PY) bench/kernels.py --json bench/results/kernels.json
	$(PY) bench/kernels_step.py --json bench/results/kernels_step.json
