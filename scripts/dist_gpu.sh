#!/usr/bin/env bash
# Sharded training on the GPU host (after `source .gpu/env/gpu.sh`): benchmarks/dist_train_step.py
# under torchrun. Usage: scripts/dist_gpu.sh small|probe|first|large|fp8 [extra args]
#   small: Llama-3.2-1B shapes, HF + Liger and coda, on 1 GPU (unwrapped), 2 and 4 GPUs (FSDP2 per
#          decoder layer, DDP), one Chrome trace per configuration on 2 GPUs, its overlap summarised
#   probe: 2 GPUs, FSDP2 per layer (resharding or not) and DDP, the kernels of one traced step
#   first: the first step from an empty cache on 1 GPU and 4 ranks, and after coda precompile
#   large: Llama-3-8B shapes on 4 GPUs, FSDP2 per decoder layer
#   fp8:   the same, coda bf16 and fp8="delayed" against torchao float8 tensorwise and rowwise (one run each)
# Logs and JSON go to $OUT. NVLink multicast stays off (the host's variables are kept, and set here).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
what="${1:-small}"; [ $# -gt 0 ] && shift
OUT="${OUT:-$(mktemp -d -t coda-dist-XXXX)}"; mkdir -p "$OUT"
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/coda-gpu/pycache}"
fi
export CODA_CACHE_DIR="${CODA_CACHE_DIR:-/tmp/coda-gpu/cache/coda}" QUACK_CACHE_DIR="${QUACK_CACHE_DIR:-/tmp/coda-gpu/cache/quack}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
mkdir -p "$CODA_CACHE_DIR" "$QUACK_CACHE_DIR"
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
run() {  # run NAME NPROC ARGS...
  local name=$1 n=$2; shift 2
  echo "== $name: $n GPU(s) $(date -u +%T)"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 560 torchrun --standalone --nproc_per_node "$n" \
    benchmarks/dist_train_step.py --json "$OUT/$name.json" "$@" 2>&1 | grep -v "^\[W" | tee "$OUT/$name.log" | tail -12
}
case "$what" in
  small)
    run x2 2 --patch liger,coda --wrap fsdp-layer,ddp --trace "/tmp/trace-{config}.json" "$@"
    python benchmarks/trace_overlap.py /tmp/trace-*.json | tee "$OUT/overlap.md"
    run x1 1 --patch liger,coda --wrap none "$@"
    [ "$ngpu" -ge 4 ] && run x4 4 --patch liger,coda --wrap fsdp-layer,ddp "$@"
    ;;
  probe)  # where FSDP2 per layer spends its time: kernels of one traced step, coda and Liger
    rm -f /tmp/trace-*.json
    run probe 2 --patch liger,coda --wrap fsdp-layer,fsdp-layer-keep,ddp --trace "/tmp/trace-{config}.json" "$@"
    python benchmarks/trace_overlap.py --top 30 /tmp/trace-*.json | tee "$OUT/probe.md"
    ;;
  first)  # the first step from an empty kernel cache: 1 GPU, 4 ranks, and 1 GPU after coda precompile
    python -c "import sys; sys.path.insert(0, 'benchmarks'); from hf_train_step import llama_config; llama_config(16).save_pretrained('/tmp/cfg-1b')"
    fresh() { rm -rf "$CODA_CACHE_DIR" "$QUACK_CACHE_DIR"; mkdir -p "$CODA_CACHE_DIR" "$QUACK_CACHE_DIR"; }
    fresh; run first-x1 1 --patch coda --wrap none --steps 2 --warmup 1 "$@"
    fresh; [ "$ngpu" -ge 4 ] && run first-x4 4 --patch coda --wrap fsdp-layer --steps 2 --warmup 1 "$@"
    fresh; echo "== coda precompile $(date -u +%T)"; /usr/bin/time -f "precompile: %e s" python -m coda_lang.cli precompile --model /tmp/cfg-1b --seq 8192 -q
    run first-x1-precompiled 1 --patch coda --wrap none --steps 2 --warmup 1 "$@"
    grep -h first_step_s "$OUT"/first-*.log | python -c "import sys, json; [print(json.loads(l)['world'], 'GPU(s):', round(json.loads(l)['first_step_s'], 1), 's') for l in sys.stdin]"
    ;;
  large)
    run x4-8b 4 --patch liger,coda --wrap fsdp-layer --layers 32 --hidden 4096 --intermediate 14336 \
      --heads 32 --kv-heads 8 --vocab 128256 --untied --steps 5 --warmup 2 "$@"
    ;;
  fp8)  # Llama-3-8B shapes on 4 GPUs, FSDP2 per decoder layer: coda bf16, coda fp8="delayed", torchao float8
    for p in coda coda-fp8 torchao-tensorwise torchao-rowwise; do
      run "x4-8b-$p" 4 --patch "$p" --wrap fsdp-layer --layers 32 --hidden 4096 --intermediate 14336 \
        --heads 32 --kv-heads 8 --vocab 128256 --untied --steps 5 --warmup 2 "$@"
    done
    ;;
esac
