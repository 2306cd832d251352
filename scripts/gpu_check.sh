#!/usr/bin/env bash
# One command on the GPU host (after `source .gpu/env/gpu.sh`, from the project root or anywhere):
#   scripts/gpu_check.sh [all|tests|fuzz|memcheck|bench] [extra args for benchmarks/gpu_bench.py]
# runs the GPU tests (python -m pytest -q -m gpu tests/, in nine processes), `coda fuzz --target cuda` on every example
# (200 cases each, in FUZZ_JOBS=4 processes; FUZZ_EXAMPLES="examples/a.coda ..." picks some) and on random programs (PROGRAMS=240
# drawn, of which the backend refuses about half, in SHARDS=12 processes), all in parallel (compiles are
# CPU-bound; FUZZ_ARGS="--special" adds non-finite inputs), then on every fp8 block a patched Hugging
# Face model runs (scripts/fuzz_hf_blocks.py: each family's program in bf16 and each fp8 recipe), then a
# summary with the number of programs run; then every example forward and backward (--remat auto and save, and in row chunks) under
# compute-sanitizer's memcheck (scripts/memcheck_examples.py, with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so
# that torch's caching allocator hides no out-of-bounds access; run once without the sanitizer first,
# which compiles the kernels into the cache; $COMPUTE_SANITIZER names the binary, default: on PATH or
# under $CUDA_HOME or /usr/local/cuda; any memcheck error fails the check); and then the
# benchmark (python benchmarks/gpu_bench.py), printing each; logs (and the benchmark's JSON) go to $OUT
# (a fresh temporary folder when $OUT is unset). Compiled kernels are cached under /tmp/coda-gpu/cache
# (coda's PTX and emitted epilogues, quack's .o files), so a second run on the same host skips the
# compiles (when /tmp/coda-gpu is not a private folder of this user's, a fresh temporary one instead). Exit status: non-zero if the tests or the benchmark failed.
# (The device's copy of the tree may carry a stale .git: don't run git commands there.)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
what="${1:-all}"
[ $# -gt 0 ] && shift
OUT="${OUT:-$(mktemp -d -t coda-gpu-XXXX)}"
export OUT
mkdir -p "$OUT"
# The caches below hold code that runs (bytecode, kernels): under /tmp only in a folder of this user's
# that no one else can write (one another user made first, or can write, is not used: a fresh one is)
CACHE_ROOT=/tmp/coda-gpu
mkdir -p -m 700 "$CACHE_ROOT" 2>/dev/null
if [ ! -O "$CACHE_ROOT" ] || [ -n "$(find "$CACHE_ROOT" -maxdepth 0 -perm /022)" ]; then
  CACHE_ROOT="$(mktemp -d -t coda-gpu-cache-XXXX)"
  echo "warning: /tmp/coda-gpu is not a private folder of this user's: caching in $CACHE_ROOT" >&2
fi
# Python bytecode cached, as a pip install has it (the GPU host sets PYTHONDONTWRITEBYTECODE and its
# packages carry no .pyc: every process and compile worker would byte-compile torch and CuTeDSL again)
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$CACHE_ROOT/pycache}"
fi
export CODA_CACHE_DIR="${CODA_CACHE_DIR:-$CACHE_ROOT/cache/coda}"
export QUACK_CACHE_DIR="${QUACK_CACHE_DIR:-$CACHE_ROOT/cache/quack}"
mkdir -p "$CODA_CACHE_DIR" "$QUACK_CACHE_DIR"

{
  echo "== $(date -u +%FT%TZ) $(hostname) $(git rev-parse --short HEAD 2>/dev/null) (+ working tree)"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv 2>&1
  python - <<'PY'
import importlib.metadata as md, shutil, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for d in ("nvidia-cutlass-dsl", "quack-kernels", "triton", "apache-tvm-ffi", "numpy", "ml_dtypes", "lark"):
    try:
        print(f"  {d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"  {d} missing")
print("  ptxas on PATH:", shutil.which("ptxas"))
PY
} 2>&1 | tee "$OUT/env.txt"

rc_tests=0
rc_bench=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  echo "== GPU tests (nine pytest processes in parallel: in one, the files beside test_gpu.py alone take over 10 minutes)"
  groups=("ragged_end or dims or min_and or pick or scalar or fresh" "forward_matches or partials"
          "backward_block or autograd_matches or backward_matches_vjp"
          "not (ragged_end or dims or min_and or pick or scalar or fresh or forward_matches or partials or backward_block or autograd_matches or backward_matches_vjp)")
  i=0
  for k in "${groups[@]}"; do
    python -m pytest -q -m gpu tests/test_gpu.py -k "$k" -p no:logging -p no:cacheprovider -rfEs \
      --junitxml="$OUT/pytest_$i.xml" > "$OUT/pytest_$i.log" 2>&1 &
    i=$((i + 1))
  done
  # the other files with GPU tests, in four named groups and one of whatever else (a new file lands there)
  files=("tests/test_hf.py tests/test_hf_accelerate.py" "tests/test_hf_lora.py"
         "tests/test_chunked.py tests/test_fuzz.py" "tests/test_precompile.py tests/test_tune.py")
  rest=(--ignore=tests/test_gpu.py)
  for f in ${files[@]}; do rest+=(--ignore="$f"); done
  for fs in "${files[@]}"; do
    # shellcheck disable=SC2086
    python -m pytest -q -m gpu $fs -p no:logging -p no:cacheprovider -rfEs \
      --junitxml="$OUT/pytest_$i.xml" > "$OUT/pytest_$i.log" 2>&1 &
    i=$((i + 1))
  done
  python -m pytest -q -m gpu tests/ "${rest[@]}" -p no:logging -p no:cacheprovider -rfEs \
    --junitxml="$OUT/pytest_$i.xml" > "$OUT/pytest_$i.log" 2>&1 &
  wait
  for log in "$OUT"/pytest_*.log; do echo "$(basename "$log"): $(tail -1 "$log")"; done
  if grep -q -E "[0-9]+ (failed|error)" "$OUT"/pytest_*.log || ! grep -q " passed" "$OUT"/pytest_*.log; then
    rc_tests=1
  fi
fi
if [ "$what" = all ] || [ "$what" = fuzz ]; then
  echo "== coda fuzz --target cuda"
  for f in ${FUZZ_EXAMPLES:-examples/*.coda}; do
    ( python -m coda_lang.cli fuzz "$f" --target cuda --examples 200 --jobs "${FUZZ_JOBS:-4}" ${FUZZ_ARGS:-} \
        > "$OUT/fuzz_$(basename "$f" .coda).log" 2>&1
      echo "rc=$?" >> "$OUT/fuzz_$(basename "$f" .coda).log" ) &
  done
  # random programs: PROGRAMS drawn (about half are ones the backend refuses, E07, and are skipped), in
  # SHARDS processes with seeds 0..SHARDS-1 (compiles are CPU-bound)
  shards="${SHARDS:-12}"
  per=$(( (${PROGRAMS:-240} + shards - 1) / shards ))
  for s in $(seq 0 $((shards - 1))); do
    ( python -m coda_lang.cli fuzz --programs "$per" --seed "$s" --examples 2 --target cuda --tile 128x128 \
        --no-shrink --save-dir "$OUT" ${FUZZ_ARGS:-} > "$OUT/fuzz_programs_$s.log" 2>&1
      echo "rc=$?" >> "$OUT/fuzz_programs_$s.log" ) &
  done
  wait
  # every block a patched Hugging Face model runs (each family's program in bf16 and each fp8 recipe)
  python scripts/fuzz_hf_blocks.py --target cuda --examples 6 --jobs "${FUZZ_JOBS:-4}" \
      > "$OUT/fuzz_hf_blocks.log" 2>&1
  echo "rc=$?" >> "$OUT/fuzz_hf_blocks.log"
  for log in "$OUT"/fuzz_*.log; do echo "$(basename "$log"): $(tail -2 "$log" | tr '\n' ' ')"; done
  cat "$OUT"/fuzz_programs_*.log | python -c "import re, sys; t = sys.stdin.read(); print('random programs run:', sum(int(n) for n in re.findall(r'ok: (\\d+) random programs', t)), '(failed shards:', t.count('wrote the failing program'), ')')"
  grep -q "^rc=[^0]" "$OUT"/fuzz_*.log && rc_tests=1
fi
if [ "$what" = all ] || [ "$what" = memcheck ]; then
  echo "== compute-sanitizer memcheck: every example forward and backward (scripts/memcheck_examples.py)"
  sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do
    [ -z "$sanitizer" ] && [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ] && sanitizer="$d/bin/compute-sanitizer"
  done
  if [ -z "$sanitizer" ] || [ ! -x "$sanitizer" ]; then
    echo "memcheck: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)"
    rc_tests=1
  else
    # one pipeline per example, all in parallel (compiles are CPU-bound): first without the sanitizer,
    # which compiles its kernels into the caches above (and checks the runs), then under it
    rc_memcheck=0
    for f in ${MEMCHECK_EXAMPLES:-examples/*.coda}; do
      b=$(basename "$f" .coda)
      ( python scripts/memcheck_examples.py "$f" > "$OUT/memcheck_warm_$b.log" 2>&1
        echo "rc=$?" >> "$OUT/memcheck_warm_$b.log"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --report-api-errors no --error-exitcode 9 \
          --print-limit 100 python scripts/memcheck_examples.py "$f" > "$OUT/memcheck_$b.log" 2>&1
        echo "rc=$?" >> "$OUT/memcheck_$b.log" ) &
    done
    wait
    # each example: its run without the sanitizer exits 0; under it, the sanitizer exits 0 (9 on a
    # memcheck error, 1 from the script on a failed run), every process's "ERROR SUMMARY: 0 errors" (a
    # process the script starts, e.g. a torch.compile worker, has an ERROR SUMMARY of its own), and
    # "memcheck_examples: all runs ok"
    for log in "$OUT"/memcheck_*.log; do
      case "$log" in
        *memcheck_warm_*) grep -q "^rc=0$" "$log" || { echo "memcheck: $(basename "$log"): failed without the sanitizer"; rc_memcheck=1; } ;;
        *) if ! grep -q "^rc=0$" "$log" || ! grep -q "ERROR SUMMARY: 0 errors" "$log" \
              || grep -q -E "ERROR SUMMARY: [1-9]" "$log" || ! grep -q "memcheck_examples: all runs ok" "$log"; then
             grep -E "^(FAILED|skip)|ERROR SUMMARY: [1-9]|Invalid" "$log" | head -5
             echo "memcheck: $(basename "$log"): FAILED"; rc_memcheck=1
           else
             echo "memcheck: $(basename "$log" .log | sed 's/^memcheck_//'): $(grep -c ': ok ' "$log") runs, no errors"
           fi ;;
      esac
    done
    if [ "$rc_memcheck" -ne 0 ]; then
      echo "memcheck: FAILED (logs: $OUT/memcheck_*.log)"
      rc_tests=1
    else
      echo "memcheck: no errors"
    fi
  fi
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  echo "== benchmark"
  python benchmarks/gpu_bench.py "$@" 2>&1 | tee "$OUT/bench.log"
  rc_bench=${PIPESTATUS[0]}
fi
echo "== tests rc=$rc_tests bench rc=$rc_bench; logs in $OUT"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
