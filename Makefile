# The whole set-up is `make demo` or `make test`: each creates .venv if needed,
# installs the project (skipped when pyproject.toml and constraints.txt are unchanged), then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-cluster test-fast test-long test-gpu install clean bench cluster-up cluster-down

# pip byte-compiles the ~20,000 installed modules one at a time; compileall does the same on every core (fresh
# clones on 2 cores, alternating: 70-104 s, against 98-129 s for pip's own). Its exit status is not checked: like
# pip, it meets a few files that only a newer Python parses (torch's tests), which stay uncompiled as under pip.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[dev]'
	@$(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
	@touch $(STAMP)

install: $(STAMP)

# A tiny ProLIP (probabilistic: sigma^2 per image and caption) on the bundled digits; configs/demo.yaml is the tiny CLIP.
demo: $(STAMP)
	$(PY) -m jobs.pretrain --config configs/prolip_demo.yaml

# Everything one node can show. Two pytest workers, one per core: the long Ray runs go to one while the other takes
# the short tests. Modules sharing a trained or downloaded fixture run in one worker, longest first
# (tests/conftest.py; xdist would otherwise start the groups with the most tests first). Every deadline in the tests
# scales with the machine's measured speed (tests/pace.py; PROBVLP_TEST_SLOWNESS sets it).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=20 tests

# The tests on nodes that share no disk (marker cluster: a local autoscaling cluster, isolated raylets, S3 on
# loopback; their fixtures in tests/multinode.py) and the outage of a tracking server under a running job, in one
# pytest process and never beside other Ray work: their nodes, servers and jobs take both cores.
test-cluster: $(STAMP)
	$(PY) -m pytest -q -m "cluster and not long" --durations=0 tests

# No Ray, no training, no servers: formulas, models, metrics, configs, readers (~1 minute on 2 cores).
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
	rm -rf $(VENV) mlruns.db mlruns_artifacts .probvlp
