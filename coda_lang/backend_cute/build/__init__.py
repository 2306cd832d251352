"""Building kernels, without a GPU: tile configs and their rules, PTX, ptxas reports, the kernel cache,
compiling in worker processes, choosing tiles by spills, and the tuning cache.

config.py (TileConfig, the candidates, `fits`), ptxas.py, cache.py, compile.py (one stage at one tile),
parallel.py (many at once, in spawned workers that never touch the GPU), select.py (the first
candidate without spills, or every such one), quack_adapter.py (the one module that imports quack and
CuTeDSL) and tune.py (timing on the GPU, and the choices kept in the cache). It reads plan/'s specs
and emitted sources and imports nothing of runtime/.
"""
