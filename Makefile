# The whole set-up is `make demo` or `make test`: each creates .venv if needed, installs requirements.lock and the
# project (skipped when the lock, pyproject.toml and constraints.txt are unchanged), then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Every package of .venv at one version: compiled by `make lock` from pyproject.toml's dependencies and its dev extra
# under constraints.txt; tests/test_lock.py fails when .venv or pyproject drifts from it.
LOCK   := requirements.lock
# The lock's compiler, pip-compile (pip-tools): pip's own resolver and configuration (this machine's wheels and its
# torch cap), both pinned in constraints.txt; in a venv of its own with uv, the installer, being no packages of the
# project's. No hashes: pip-compile downloads every file of a release to hash it (tens of GB for torch's).
TOOLS  := .venv-tools
UV     := $(TOOLS)/bin/uv
# uv reads no pip configuration: the indexes and wheel folders pip is configured with (pip config files and PIP_*
# variables, as `pip config list` shows them) are handed to it (UV_FROM_PIP, run once by the recipe's shell), so that a
# machine set up for pip installs from the same places; every index on an equal footing, as pip treats them (uv's
# default takes a package from the first index that has it, at any version).
UV_FROM_PIP = $$($(PYTHON) -c "$$PIP_TO_UV")
define PIP_TO_UV
import re, subprocess, sys
config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flag = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
args = {}
# a PIP_* variable (":env:") wins over a file
for line in sorted(config.splitlines(), key=lambda line: not line.startswith(":env:")):
    m = re.match(r"[^.]*[.]([a-z-]+)='(.*)'$$", line)
    key = m and m.group(1)
    if key in flag and not (key == "index-url" and any(a.startswith("--index-url") for a in args)):
        args.update(dict.fromkeys(f"{flag[key]}={value}" for value in m.group(2).split()))
print(" ".join(["--index-strategy=unsafe-best-match", *args]))
endef
export PIP_TO_UV
COMPILE = CUSTOM_COMPILE_COMMAND='make lock' $(TOOLS)/bin/pip-compile -q --extra dev -c constraints.txt \
	--strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links -o $(LOCK) pyproject.toml

.PHONY: demo test test-cluster test-fast test-long test-gpu test-mutants install lock lock-upgrade clean bench cluster-up cluster-down

# Python modules are byte-compiled by the first process that imports them, written beside them (atomically, so
# processes importing at once are safe) and read by every later one: the project's processes import ~9,300 of the
# ~23,000 modules installed, so nothing is compiled at install (uv compiles nothing unless asked; pip took ~2 min on 2
# cores with all of them compiled, 66-76 s without, 2026-12-06). PYTHONDONTWRITEBYTECODE (set on this machine and its
# CI) would make every process compile what it imports again (12 CPU-s for a training worker's 5,714 modules, measured
# 2026-12-06): the targets below run without it.
unexport PYTHONDONTWRITEBYTECODE
# The lock installed by uv (constraints.txt pins it; in the tools' venv, being no package of the project's): its ~220
# packages (6.6 GB with torch's CUDA libraries) took 26 s on 2 cores from an empty cache, against ~70 s for pip
# (2026-12-07), and `uv pip sync` uninstalls what the lock does not name (dropped by a lock upgrade, or installed by
# hand). Then pip at constraints.txt's version and the project itself, editable, without dependencies.
$(STAMP): $(LOCK) pyproject.toml constraints.txt $(UV)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	from_pip=$(UV_FROM_PIP) && \
	$(UV) pip sync -q --python $(PY) $$from_pip $(LOCK) && \
	$(UV) pip install -q --python $(PY) $$from_pip -c constraints.txt pip && \
	$(UV) pip install -q --python $(PY) $$from_pip --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

$(TOOLS)/bin/pip-compile $(UV): constraints.txt
	@test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q -c constraints.txt pip pip-tools uv
	@touch $(TOOLS)/bin/pip-compile $(UV)

# After editing pyproject.toml's dependencies or constraints.txt: recompile the lock, keeping every other pin.
lock: $(TOOLS)/bin/pip-compile
	$(COMPILE)

# Every package to the newest release that pyproject.toml and constraints.txt allow (torch, Ray, DeepSpeed, faiss, pip
# and pip-tools stay at constraints.txt's pins, moved by hand), .venv re-installed from it, then the fast tests.
lock-upgrade: $(TOOLS)/bin/pip-compile
	$(COMPILE) --upgrade
	$(MAKE) test-fast

# A tiny ProLIP (probabilistic: sigma^2 per image and caption) on the bundled digits; configs/demo.yaml is the tiny CLIP.
demo: $(STAMP)
	$(PY) -m jobs.pretrain --config configs/prolip_demo.yaml

# Everything one node can show. Two pytest workers, one per core: the long Ray runs go to one while the other takes
# the short tests. Modules sharing a trained or downloaded fixture run in one worker, longest first
# (tests/conftest.py; xdist would otherwise start the groups with the most tests first). Every deadline in the tests
# scales with the machine's measured speed (tests/pace.py; PROBVLP_TEST_SLOWNESS sets it).
TEST_WORKERS ?= 2
DURATIONS ?= 20

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=$(DURATIONS) tests

# The tests on nodes that share no disk (marker cluster: a local autoscaling cluster, isolated raylets, S3 on
# loopback; their fixtures in tests/multinode.py) and the outage of a tracking server under a running job, run alone:
# two pytest workers, each module in one (its cluster and servers started once), the two longest first. One at a
# time left the cores idle a third of the run (restarts, drains and outages waited out: docs/RESULTS.md); two
# together peaked at 18.6 GiB in use of 23 (sampled every 2 s).
test-cluster: $(STAMP)
	$(PY) -m pytest -q -m "cluster and not long" -n 2 --dist loadgroup --no-loadscope-reorder --durations=0 tests

# No Ray, no training, no servers: formulas, models, metrics, configs, readers (3 min 36 s on 2 cores, 596 tests,
# 2026-12-06).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not pending and not long" tests

# Every method trained to its accuracy target and the ProbVLM adapter's uncertainty behaviours
# (~30 min on 2 cores; outside `make test` to keep CI short).
test-long: $(STAMP)
	$(PY) -m pytest -q -m long tests

# The GPU tests (marker gpu; in `make test` too, where they skip on a machine without a GPU), at most 8 minutes on
# one H100 / H200. On the GPU machine, which has no network: `source .gpu-carry/enter.sh && make test-gpu`
# (its python3 with the carried packages; ../shared/gpu/README.md); elsewhere the project's .venv.
test-gpu:
	$(if $(wildcard $(PY)),$(PY),python3) -m pytest -q -m gpu --durations=0 tests

# The mutation list (tests/mutants.py): each rule of the fault-tolerance code removed in a scratch copy, its tests run
# there; prints killed / survived per rule and fails unless every mutant is killed (45 min on 2 cores, 2026-12-07).
test-mutants: $(STAMP)
	$(PY) -m tests.mutants

bench: $(STAMP)
	$(PY) -m benchmarks.losses
	$(PY) -m benchmarks.data
	$(PY) -m benchmarks.train_step
	$(PY) -m benchmarks.adapter
	$(PY) -m benchmarks.retrieval_index
	$(PY) -m benchmarks.peers
	$(PY) -m benchmarks.peers --data
	$(PY) -m benchmarks.startup

# A local autoscaling Ray cluster with ray_cluster.yaml's node types (Ray's fake multi-node provider; 127.0.0.1,
# token auth): `cluster-up` prints the RAY_ADDRESS to `ray job submit` to; worker nodes come and go with demand.
cluster-up: $(STAMP)
	$(PY) -m pipelines.cluster.local up

cluster-down: $(STAMP)
	$(PY) -m pipelines.cluster.local down

clean:
	rm -rf $(VENV) $(TOOLS) mlruns.db mlruns_artifacts .probvlp
