#!/usr/bin/env bash
# The Triton kernels compiled on a CUDA GPU: their tests against the torch references, then their
# timings (bench/kernels_gpu.py). For a lent GPU machine without our .venv:
#
#     bash bench/gpu_check.sh        (from the repo root; python3 with torch, triton, transformers, pytest)
#
# Without CUDA the tests would quietly run interpreted on the CPU (tests/conftest.py), so this stops
# first. The test files run as four pytest processes side by side (Triton compiles ~200 kernel
# specializations, each on one CPU core), each under TEST_LIMIT_S; the benchmark runs after them on an
# idle GPU under BENCH_LIMIT_S. Both stop with SIGINT, so what ran is still reported. Everything goes
# to $OUT (default: a new temporary folder): gpu_check.log (this output), pytest_<group>.log and
# junit_<group>.xml per group, and kernels_gpu.json (also in bench/results/). Exits non-zero when a
# group or the benchmark fails; the later steps run anyway. About 2-3 minutes on an H200; at most the
# two limits plus about a minute.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
TEST_LIMIT_S="${TEST_LIMIT_S:-150}"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-120}"
BENCH_ARGS=(--tokens 1 64 512 --context 2048)  # decode at batch 1, 64 and 512
GROUPS_ORDER=(ops moe attention models)
# the last group: only the tests marked gpu there, which compare whole models and the engine
declare -A GROUP_ARGS=(
  [ops]="tests/test_triton_ops.py"
  [moe]="tests/test_triton_moe.py"
  [attention]="tests/test_triton_attention.py tests/test_triton_mla.py"
  [models]="-m gpu tests/test_triton_model.py tests/test_more_families.py tests/test_engine.py"
)

versions() {
  nvidia-smi -L
  python3 - <<'PY'
import sys, torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device; stopping before the tests run interpreted on the CPU")
print(f"{torch.cuda.get_device_name()}, compute capability {torch.cuda.get_device_capability()}")
PY
}

tests() {
  local name rc status=0
  declare -A pids=()
  for name in "${GROUPS_ORDER[@]}"; do
    # on SIGINT pytest stops, prints its summary and still writes the junit XML
    # shellcheck disable=SC2086  # the group's arguments split on purpose
    OMP_NUM_THREADS=4 timeout -s INT -k 15 "$TEST_LIMIT_S" python3 -m pytest -q -rfEs --tb=short --durations=5 \
      -p no:cacheprovider --junitxml="$OUT/junit_$name.xml" ${GROUP_ARGS[$name]} >"$OUT/pytest_$name.log" 2>&1 &
    pids[$name]=$!
  done
  for name in "${GROUPS_ORDER[@]}"; do
    wait "${pids[$name]}"
    rc=$?
    echo "=== pytest ${GROUP_ARGS[$name]}: exit $rc$([ "$rc" -eq 124 ] && echo ", stopped at ${TEST_LIMIT_S} s")"
    grep -E "^(FAILED|ERROR) |^[0-9]+ [a-z]+.* in [0-9.]+s|^no tests ran|KeyboardInterrupt" "$OUT/pytest_$name.log" |
      tail -n 15
    [ "$rc" -eq 0 ] || status=1
  done
  return "$status"
}

bench() {
  local rc
  echo "=== bench/kernels_gpu.py ${BENCH_ARGS[*]}"
  touch "$OUT/.bench_start"
  timeout -s INT -k 15 "$BENCH_LIMIT_S" python3 bench/kernels_gpu.py "${BENCH_ARGS[@]}"
  rc=$?
  if [ bench/results/kernels_gpu.json -nt "$OUT/.bench_start" ]; then
    cp bench/results/kernels_gpu.json "$OUT/"
  else
    echo "bench: wrote no bench/results/kernels_gpu.json"
  fi
  rm -f "$OUT/.bench_start"
  return "$rc"
}

main() {
  local status=0
  export PYTHONUNBUFFERED=1 SHUTTLE_ENFORCE_EAGER=1
  unset TRITON_INTERPRET SHUTTLE_KERNELS  # compiled kernels; each test names its backend itself
  versions || return 1
  tests || status=1
  echo "tests took $SECONDS s"
  bench || { status=1; echo "bench: failed"; }
  echo "gpu_check: exit $status after $SECONDS s; files in $OUT"
  return "$status"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
