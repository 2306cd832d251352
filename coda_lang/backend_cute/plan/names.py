"""The names an emitted epilogue module has: what it imports, and so what no value may be called.

What it does: `imports()` maps each name the emitted code may use to the import line that provides it:
the module's own (CuTeDSL's `cute`, `cutlass` and dtypes, quack's decorator, epilogue ops and pair
helpers, coda_lang's own epilogue ops and its gated fp8 TileStore) and every op's (`Lowerings.cute_imports`: an emitter that calls
`pexp` or `silu` names its import there). `helper_names()` is that set plus the builtins the
emitted code calls: the planner and the emitter rename a value that would shadow one.
What it does not: decide which names a given kernel imports (emit.py imports only those it uses).
Invariants: one table, read by both the planner and the emitter, so the two can't drift apart; two
sources giving one name two different imports is an error at import time.
"""

from __future__ import annotations

from functools import cache

from coda_lang.ops import REGISTRY

_MODULE_IMPORTS: dict[str, str] = {
    "cutlass": "import cutlass",
    "cute": "import cutlass.cute as cute",
    "BFloat16": "from cutlass import BFloat16",
    "Float16": "from cutlass import Float16",
    "Float32": "from cutlass import Float32",
    "Int32": "from cutlass import Int32",
    "gemm_epilogue": "from quack.epilogue.frontend import gemm_epilogue",
    "pack": "from quack.epilogue.math import pack",
    "unpack": "from quack.epilogue.math import unpack",
    "ColVecLoad": "from quack.epilogue.ops import ColVecLoad",
    "ColVecReduce": "from quack.epilogue.ops import ColVecReduce",
    "OnlineLSEReduce": "from quack.epilogue.ops import OnlineLSEReduce",
    "RowVecLoad": "from quack.epilogue.ops import RowVecLoad",
    "RowVecReduce": "from quack.epilogue.ops import RowVecReduce",
    "Scalar": "from quack.epilogue.ops import Scalar",
    "TileLoad": "from quack.epilogue.ops import TileLoad",
    "TileStore": "from quack.epilogue.ops import TileStore",
    "GroupedReduce": "from coda_lang.backend_cute.plan.epi_ops import GroupedReduce",
    "round_odd_bf16": "from coda_lang.backend_cute.plan.epi_ops import round_odd_bf16",
    "round_odd_f16": "from coda_lang.backend_cute.plan.epi_ops import round_odd_f16",
    "unpack_bf16x2": "from coda_lang.backend_cute.plan.epi_ops import unpack_bf16x2",
    "unpack_f16x2": "from coda_lang.backend_cute.plan.epi_ops import unpack_f16x2",
    "pack_e4m3x2": "from coda_lang.backend_cute.plan.epi_ops import pack_e4m3x2",
    "unpack_e4m3x2": "from coda_lang.backend_cute.plan.epi_ops import unpack_e4m3x2",
    "unpack_e5m2x2": "from coda_lang.backend_cute.plan.epi_ops import unpack_e5m2x2",
    "pack_e5m2x2": "from coda_lang.backend_cute.plan.epi_ops import pack_e5m2x2",
    "BoundedColVecSelect": "from coda_lang.backend_cute.plan.epi_ops import BoundedColVecSelect",
    "BoundedColVecReduce": "from coda_lang.backend_cute.plan.epi_ops import BoundedColVecReduce",
    "BoundedRowVecReduce": "from coda_lang.backend_cute.plan.epi_ops import BoundedRowVecReduce",
    "TileIndex": "from coda_lang.backend_cute.plan.epi_ops import TileIndex",
    "GroupColumnLoad": "from coda_lang.backend_cute.plan.epi_ops import GroupColumnLoad",
    "GatedFp8Store": "from coda_lang.backend_cute.plan.gated_store import GatedFp8Store",
    "BlockScale": "from coda_lang.backend_cute.plan.block_scaled import BlockScale",
}

# Python names the emitted code uses without importing them
_BUILTINS = frozenset({"abs", "math", "acc"})


@cache
def imports() -> dict[str, str]:
    """Every name the emitted code may use -> the line that imports it."""
    table = dict(_MODULE_IMPORTS)
    for op in REGISTRY.values():
        for name, line in op.lower.cute_imports:
            if table.setdefault(name, line) != line:
                raise AssertionError(
                    f"`{name}` is imported as `{table[name]}` and, by `{op.name}`, as `{line}`"
                )
    return table


@cache
def helper_names() -> frozenset[str]:
    """Names a value of the emitted code must not take (it is renamed `v_<name>`)."""
    return frozenset(imports()) | _BUILTINS
