source .gpu/env/gpu.sh >/dev/null 2>&1 || source .gpu/b/gpu.sh >/dev/null 2>&1
source gpu_tmp/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 580 python benchmarks/convergence.py train --data gpu_tmp/stdlib --configs coda,coda-fp8 --steps 1000 --json $OUT/conv.json 2>&1 | grep -v "^coda: \|Warning\|warn(" | tail -30
