source .gpu/b/gpu.sh >/dev/null; source gpu_tmp/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_fp8_kernels.py tests/test_layouts.py -k "mlp_backward or packed_e5m2 or transposed or delayed_backward" 2>&1 | tail -4
timeout 360 python benchmarks/hf_train_step.py --configs coda-fp8,coda --steps 3 --warmup 1 2>&1 | tail -25
