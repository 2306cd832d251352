"""`coda run`: run a block on the NumPy reference interpreter (random seeded inputs, or --inputs)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.api import Block
from coda_lang.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    load_block,
    parse_dims,
    parse_tile,
    usage_error,
    write_npz,
)
from coda_lang.cli.npz import BadInputs, read_npz
from coda_lang.core.diagnostics import CodaError, render_all


def add_parser(sub: Any) -> None:
    r = sub.add_parser(
        "run",
        help="run a block with the NumPy reference interpreter",
        description="Run a block on the NumPy reference interpreter (the executable spec). "
        "Without --inputs, inputs are random and seeded; dims not given default to 256.",
    )
    r.add_argument("file", metavar="FILE")
    r.add_argument("--block", metavar="NAME", help="the block to run (needed when the file has several)")
    r.add_argument("--dims", metavar="M=..,D=..", help="sizes of the dims, e.g. M=4096,D=1024,F=2816")
    r.add_argument("--inputs", metavar="IN.npz", help="inputs by parameter name (default: random)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs, a number >= 0 (default 0)")
    r.add_argument("--out", metavar="OUT.npz", help="write the outputs here (written atomically)")
    r.add_argument(
        "--sim-tile",
        metavar="MxN",
        help="simulate a kernel's tiling, e.g. 128x256: per-tile partials, then combined (default: whole "
        "matrices)",
    )
    r.add_argument("--tile", help=argparse.SUPPRESS)  # the kernels' tile elsewhere: a usage error here
    r.add_argument(
        "--precision",
        choices=("exact", "f64"),
        default="exact",
        help="exact: the kernel's numerics (f32 stages, rounded stored tiles); f64: float64, no rounding",
    )
    r.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.interp import (
        random_inputs,
    )

    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.interp.inputs import (
        available_memory,
        check_sizes,
        infer_dims,
    )

    if args.seed < 0:
        return usage_error(f"--seed takes a number >= 0, got {args.seed}")
    block, code = load_block(args.file, args.block)
    if block is None:
        return code

    assert isinstance(block, Block)
    dims = parse_dims(args.dims)
    if isinstance(dims, str):
        return usage_error(dims)
    if args.tile is not None:
        return usage_error(
            "coda run simulates a tile: --sim-tile MxN (--tile is the kernels' tile, of coda compile "
            "and coda fuzz --target cuda)"
        )
    tile = parse_tile(args.sim_tile)
    if tile == "bad":
        return usage_error(f"--sim-tile takes MxN with positive sizes (e.g. 128x256), got {args.sim_tile!r}")
    try:
        if args.inputs:
            try:
                inputs = read_npz(args.inputs, available_memory())
            except OSError as e:
                return usage_error(f"can't read {args.inputs}: {e.strerror or e}")
            except BadInputs as e:
                return usage_error(f"can't read {args.inputs}: {e}")
            source = f"inputs from {args.inputs}"
            sizes = infer_dims(
                block.ir,
                {k: v.shape for k, v in inputs.items() if k in {p.var.name for p in block.ir.params}},
                dims,
            )
            check_sizes(block.ir, sizes, args.precision, tile)
        else:
            sizes = {d.name: dims.get(d.name, d.value or 256) for d in block.ir.dims}
            unknown = set(dims) - set(sizes)
            if unknown:
                return usage_error(
                    f"unknown dim {sorted(unknown)[0]}; {block.name} has dims {', '.join(sizes)}"
                )
            sizes = infer_dims(block.ir, {}, sizes)
            check_sizes(block.ir, sizes, args.precision, tile)
            inputs = random_inputs(block.ir, sizes, args.seed)
            source = f"random inputs, seed {args.seed}"
        outs = block.run(inputs, dims=sizes, sim_tile=tile, precision=args.precision)  # type: ignore[arg-type]
    except CodaError as e:
        print(render_all(e.diagnostics, {}, "human"), file=sys.stderr)
        return EXIT_ERRORS
    mode = f"tiles of {tile[0]}x{tile[1]}" if isinstance(tile, tuple) else "whole matrices"
    dim_text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    print(f"{block.name} on {dim_text} ({source}; {mode}; {args.precision})")
    rows = [("output", "shape", "dtype", "mean", "max|x|")]
    for name, x in outs.items():
        a = np.asarray(x).astype(np.float64)
        dt = (
            np.asarray(x)
            .dtype.name.replace("float32", "f32")
            .replace("bfloat16", "bf16")
            .replace("float8_e4m3fn", "e4m3")
            .replace("float8_e5m2", "e5m2")
            .replace("float16", "f16")
            .replace("int32", "i32")
            .replace("float64", "f64")
        )
        rows.append(
            (
                name,
                str(tuple(a.shape)),
                dt,
                f"{a.mean():.6g}" if a.size else "-",
                f"{np.abs(a).max():.6g}" if a.size else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if args.out:
        try:
            write_npz(args.out, outs)
        except OSError as e:
            return usage_error(f"can't write {args.out}: {e.strerror or e}")
        print(f"wrote {args.out}")
    return EXIT_OK
