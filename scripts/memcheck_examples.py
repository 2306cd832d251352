#!/usr/bin/env python
"""Every example forward and backward through the CUDA runtime at small sizes: what scripts/gpu_check.sh
runs under compute-sanitizer's memcheck (issue #17), so that an out-of-bounds access in a kernel, a
launch argument or a buffer the runtime sizes wrong is an error, not a silent wrong number.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \\
        --error-exitcode 9 python scripts/memcheck_examples.py          # on the GPU host
    python scripts/memcheck_examples.py --emulate                       # the same runs on the CPU

For each block of each example (or the files given): sizes with ragged last tiles (each dim the least
multiple of its unit at or above 136: one 128-wide tile and a ragged one, rows of 16 bytes), seeded
inputs and cotangents; the forward (`Block.cuda(tune=False)`: the first spill-free tile, no timing
under the sanitizer), then the backward through `CudaBlock.autograd()` under --remat auto and save,
and once in row chunks where the backward can run in chunks; `torch.cuda.synchronize()` after each
so that an asynchronous fault is reported at its run. Every output and gradient must have the
interpreter's shape and be finite where the interpreter's is (a cheap check: the numbers are `coda
fuzz`'s to judge). Prints one line per run; exit status 1 if any run raised or gave a bad result, 2
for usage errors.
`--emulate` runs the emulated kernels (torch stand-ins) on the CPU: the same script end to end without
a GPU (tests/test_memcheck_script.py runs it so in CI).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZE = 136  # 128 + 8: a full tile and a ragged one, in rows and columns


def sizes(block: Any) -> dict[str, int]:
    """Each dim the least multiple of its unit (divisibility and 16-byte rows) at or above SIZE."""
    from coda_lang.fuzz import ALIGN, Fuzzer

    units = Fuzzer(block, "interp", backward=True).units()
    align = ALIGN["cuda"]
    out = {}
    for name, unit in units.items():
        u = unit * align // _gcd(unit, align)
        out[name] = u * -(-SIZE // u)
    fixed = {d.name for d in block.ir.dims if d.value is not None}
    return {k: v for k, v in out.items() if k not in fixed}


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _check(name: str, got: Any, ref: Any) -> str | None:
    """`got` has `ref`'s shape and is finite wherever the interpreter's `ref` is."""
    import numpy as np

    from coda_lang.testing.compare import as_float64

    g, r = as_float64(got), as_float64(ref)
    if g.shape != r.shape:
        return f"{name}: shape {g.shape}, expected {r.shape}"
    bad = np.isfinite(r) & ~np.isfinite(g)
    if bad.any():
        return f"{name}: {int(bad.sum())} of {g.size} elements are not finite where the interpreter's are"
    return None


def run_block(block: Any, device: str, emulate: bool, out: list[str]) -> bool:
    """Forward and backward runs of one block; appends one line per run to `out`; False on a failure."""
    import numpy as np
    import torch

    from coda_lang.core.diagnostics import CodaError
    from coda_lang.testing.inputs import block_inputs, cotangents

    dims = sizes(block)
    all_dims = {**{d.name: d.value for d in block.ir.dims if d.value is not None}, **dims}
    arrays = block_inputs(block, all_dims, 0)
    cots = cotangents(block, all_dims, 0)

    def tensor(a: Any) -> Any:
        a = np.asarray(a)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)
        return torch.from_numpy(a.copy()).to(device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    shown = ",".join(f"{k}={v}" for k, v in dims.items())
    ok = True
    expected = block.run(arrays, dims=all_dims)  # the interpreter: shapes and where values are finite
    try:
        cb = block.cuda(emulate=emulate, tune=False)
    except CodaError as e:
        out.append(f"skip {block.name}: {e.diagnostics[0].code} {e.diagnostics[0].message}")
        return True
    runs: list[tuple[str, Any]] = [("forward", None)]
    for remat in ("auto", "save"):
        runs.append((f"backward --remat {remat}", {"remat": remat}))
    try:
        plan = block.chunk_plan(remat="auto")
        rows = all_dims.get(plan.dim, 0)
        if rows > 1:
            c = max(plan.align, (rows // 2) // plan.align * plan.align)
            runs.append((f"backward --remat auto --chunk {c}", {"remat": "auto", "chunk": c}))
    except CodaError:
        pass
    for what, kw in runs:
        t0 = time.monotonic()
        why: str | None = None
        try:
            ins = {k: tensor(v) for k, v in arrays.items()}
            if kw is None:
                got = cb(ins, dims=dims)
                sync()
                for name, ref in expected.items():
                    why = why or _check(f"output `{name}`", got[name], ref)
            else:
                fn = cb.autograd(**kw)
                d = block.derivation(remat=kw["remat"])
                wrt = [p for p in d.grads if p in ins and ins[p].is_floating_point()]
                for p in wrt:
                    ins[p] = ins[p].detach().requires_grad_(True)
                outs = fn(ins, dims=dims)
                pairs = [(outs[o], tensor(c)) for o, c in cots.items() if o in outs and outs[o].requires_grad]
                grads = torch.autograd.grad(
                    [p[0] for p in pairs],
                    [ins[p] for p in wrt],
                    grad_outputs=[p[1].to(p[0].dtype) for p in pairs],
                    allow_unused=True,
                )
                sync()
                want = block.vjp(arrays, cots, dims=all_dims, remat=kw["remat"])
                for p, g in zip(wrt, grads, strict=True):
                    if g is not None:
                        why = why or _check(f"gradient of `{p}`", g, want[p])
        except CodaError as e:
            d0 = e.diagnostics[0] if e.diagnostics else None
            if d0 is not None and d0.code.startswith("E07"):  # a stage the backend can't run yet
                out.append(f"skip {block.name} {what}: {d0.code} {d0.message}")
                continue
            why = f"raised {e}"
        except Exception:
            why = "raised " + traceback.format_exc().strip().splitlines()[-1]
        status = "ok" if why is None else "FAILED"
        out.append(
            f"{status} {block.name} {what} ({shown}) {time.monotonic() - t0:.1f} s"
            + (f": {why}" if why else "")
        )
        ok = ok and why is None
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="example files (default: examples/*.coda)")
    p.add_argument("--emulate", action="store_true", help="the emulated kernels, on the CPU")
    a = p.parse_args(argv)
    import coda_lang

    try:
        import torch
    except ImportError:
        print("memcheck_examples: needs torch", file=sys.stderr)
        return 2
    if not a.emulate and not torch.cuda.is_available():
        print(
            "memcheck_examples: no CUDA GPU here (--emulate runs the emulated kernels on the CPU)",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if a.emulate else "cuda"
    files = [Path(f) for f in a.files] or sorted((ROOT / "examples").glob("*.coda"))
    ok = True
    for path in files:
        for block in coda_lang.load(path):
            lines: list[str] = []
            ok = run_block(block, device, a.emulate, lines) and ok
            for line in lines:
                print(f"{path.name}: {line}", flush=True)
    print("memcheck_examples: " + ("all runs ok" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
