"""Registers and spills of the generated elementwise stages of a patched model's blocks, on the CPU.

Usage: python benchmarks/triton_registers.py [--family llama] [--recipe delayed|bf16]
           [--blocks first_qkv,layer,last] [--program 64x16x16] [--ptxas PATH]

A generated stage (backend_triton/generate.py) is bound by memory, so the registers a thread needs
decide how many of its programs an SM holds, and a spill adds traffic of its own. Without a GPU this
compiles each stage of the family's forward and derived backward blocks for sm_90a with Triton (its
PTX), runs `ptxas -v` on it and prints the registers and spill bytes:
- at the stage's own program shape (rows x column units x warps);
- where the stage writes K-major copies (fp8 backwards): at the copy-writing shape
  (`$CODA_KMAJOR_PROGRAM`, default 64x64x4), and at `--program`.
The backward is cut as the runtime cuts it under `$CODA_SPLIT_EPILOGUES` (its heavy epilogues as stages
of their own, runtime/split_epilogue.py; the default, auto, at Llama-3.2-1B's widths: the fp8 gate/up
data gradient's), and those stages are reported too; `CODA_SPLIT_EPILOGUES=0` reports the whole backward.
ptxas: `--ptxas`, else $CODA_PTXAS, else the one on PATH. A Triton newer than that ptxas emits a PTX
version the ptxas refuses; the script then lowers the version line to the ptxas's own (the code
uses nothing newer for sm_90a here; ptxas says so if it does). Numbers are those of this machine's
Triton, which may differ from the GPU host's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any

PTR = {"bf16": "*bf16", "f16": "*fp16", "f32": "*fp32", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5", "i32": "*i32"}


def _ptr(dtype: Any) -> str:
    import torch

    names = {
        torch.bfloat16: "bf16",
        torch.float16: "f16",
        torch.float32: "f32",
        torch.float8_e4m3fn: "e4m3",
        torch.float8_e5m2: "e5m2",
        torch.int32: "i32",
    }
    return PTR[names[dtype]]


def signature(st: Any, kern: Any) -> dict[str, str]:
    """The Triton signature of a generated stage's kernel, from its loads and stores."""
    sig: dict[str, str] = {}
    for a in kern.arg_names:
        if a in ("BM", "BC"):
            sig[a] = "constexpr"
        elif a.startswith("in"):
            ld = st.loads[int(a[2:])]
            sig[a] = "fp32" if ld.role == "scalar" else PTR[ld.dtype]
        elif a.startswith("out"):
            sig[a] = _ptr(st.store_meta[int(a[3:])][1])
        elif a.startswith("kt"):
            sig[a] = _ptr(st.store_meta[int(a[2:])][1])
        elif a.startswith("red"):
            sig[a] = "*fp32"
        else:  # sizes R, C, W and the dims' lengths
            sig[a] = "i32"
    return sig


def ptxas_report(ptx: str, ptxas: str) -> str:
    """`REGSr/SPILLB` from `ptxas -v -arch=sm_90a` (the PTX version lowered to ptxas's if refused)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        for attempt in range(2):
            with open(path, "w") as f:
                f.write(ptx)
            done = subprocess.run(
                [ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True
            )
            text = done.stderr + done.stdout
            refused = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", text)
            if refused and attempt == 0:
                ptx = re.sub(r"^\.version \S+", f".version {refused.group(1)}", ptx, flags=re.M)
                continue
            break
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    if not regs:
        return "ptxas failed: " + text.strip().splitlines()[-1][:100]
    return f"{regs[-1]}r/{spill[-1] if spill else 0}B"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama")
    p.add_argument("--recipe", choices=["delayed", "bf16"], default="delayed")
    p.add_argument("--blocks", default="first_qkv,layer,last")
    p.add_argument(
        "--program", default="64x16x16", help="another copy-writing shape RxCxW (default %(default)s)"
    )
    p.add_argument("--ptxas", default=None)
    args = p.parse_args(argv)
    ptxas = args.ptxas or os.environ.get("CODA_PTXAS") or shutil.which("ptxas")
    if not ptxas:
        p.error("no ptxas: give --ptxas PATH or set CODA_PTXAS")
    try:
        other = tuple(int(x) for x in args.program.split("x"))
        assert len(other) == 3
    except (ValueError, AssertionError):
        p.error(f"--program is {args.program!r}; it takes RxCxW, e.g. 64x16x16")
    warnings.filterwarnings("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import coda_lang
    from coda_lang.backend_cute.runtime.split_epilogue import split_epilogues, split_selection
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage, kmajor_program
    from coda_lang.hf.family import FAMILIES
    from coda_lang.hf.state import block_wrt
    from coda_lang.ir.nodes import Stage

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import fuzz_hf_blocks  # (each family's program as the patch writes it)

    if args.family not in FAMILIES:
        p.error(f"unknown family {args.family!r}; the families: {', '.join(FAMILIES)}")
    prog = coda_lang.load(fuzz_hf_blocks.source(FAMILIES[args.family], args.recipe))
    fp8 = args.recipe != "bf16"
    options = coda_lang.BackwardOptions(fp8_grads="e5m2", fp8_acc=True) if fp8 else None

    def report(ts: Any, st: Any, marks: tuple[int, ...], shape: tuple[int, int, int]) -> str:
        kern = ts.kernel(tuple(False for _n, role in st.roles if role == "scalar"), marks)
        src = ASTSource(kern, signature(st, kern), constexprs={"BM": shape[0], "BC": shape[1]})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": shape[2]})
        return ptxas_report(c.asm["ptx"], ptxas)

    for name in args.blocks.split(","):
        blk = prog[name]
        d = blk.derivation(block_wrt(blk), backward=options)
        # ($CODA_SPLIT_EPILOGUES: the backward cut as the runtime cuts it; the default, auto, at the
        # widths a patched Llama-3.2-1B binds)
        cut = split_selection()
        backward = d.backward if cut is None else split_epilogues(d.backward, cut, {"D": 2048, "F": 8192})
        for which, b in (("forward", d.forward), ("backward", backward)):
            cb = b.cuda()
            stages = [s for s in b.ir.body if isinstance(s, Stage)]
            for k, s in enumerate(stages, 1):
                if s.is_gemm:
                    continue
                st = ElementwiseStage(b, k, emulate=True)
                ts = TritonStage(st, interpret=False)
                marks = ts.kmajor_stores(cb._kmajor, cb._alone)
                own = (ts.bm, ts.bc, ts.num_warps)
                line = f"{name:10s} {which:8s} stage {k:2d} {','.join(n for n, *_ in st.store_meta):16s}"
                line += f" {'x'.join(map(str, own))}: {report(ts, st, (), own)}"
                if any(marks):
                    for shape in (kmajor_program(), other):
                        line += f"; copies {'x'.join(map(str, shape))}: {report(ts, st, marks, shape)}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
