"""Elementwise stages as generated Triton kernels (coda_lang/backend_triton/generate.py), on the CPU.

The generated kernel runs under Triton's CPU interpreter (NumPy) and is compared with the stage's
eager torch function (`ElementwiseStage._body`, the emulated kernels' path, itself checked against
the interpreter elsewhere):
- every elementwise stage of the examples and of the Hugging Face patch's blocks (forward, and backward
  with the patch's and with every gradient, and with the patch's saving every tile; OLMo 2's row
  stages beyond its layer block's forward and the patch's backward under -m slow, their backwards one
  case per block: deriving them is left to the case) that the generator accepts, at sizes that are
  multiples of no block (rows, column pairs), with random inputs: stored tiles within one bf16
  rounding (of the value's magnitude), reductions over the columns and over the rows within f32
  accumulation error;
- the stages it must refuse (a group a chunk can't hold whole, half-width tiles in a stage pairing no
  columns) and why;
- a hand-written stage with grouped sums and maxes (groups of 16 and 8, paired and not) used in their
  stage (a per-head RMSNorm), against the torch function, and a mutant with the wrong group width;
- a hand-written stage with max/min over both axes, row_index()/col_index() in a paired stage, a NaN
  and an infinity in the data, a cast, a scalar given as a tensor and as a number, a stored row
  vector and a literal;
- the loss head's dlogits stored over the logits it loads, in the kernel's wide chunks;
- which path `ElementwiseStage.function()` takes off the emulator (`CODA_ELEMENTWISE`);
- fp8 stores (a weight quantized by its scale, with its amax; an e5m2 variant; one stage storing an
  e4m3 and an e5m2 tile): the generated kernel in the emulated runtime against the interpreter's block
  (core/numerics.round_fp8) bit for bit, NaN included, on every finite code of each dtype, the
  midpoints between neighbours and the f32 values next to them, values past the largest one,
  infinities, subnormals and signed zeros, at several scales; the ties' rounding to the even code and
  the saturation checked without the interpreter; the GPU source's native conversion; fp8 loads and
  in-stage fp8 casts still refused;
- on a GPU (marked `gpu`): the compiled kernels against the torch function on the same device; the fp8
  stores against the interpreter bit for bit (NaN included), at [16384, 2048] too, and the quantizing
  block through the CUDA runtime.
"""

from __future__ import annotations

import functools
import glob
import math
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from support import NO_BACKWARD

import coda_lang
from coda_lang.backend_triton import generate
from coda_lang.backend_triton.elementwise import ElementwiseStage
from coda_lang.backend_triton.generate import TritonStage, unsupported
from coda_lang.hf.blocks import model_source
from coda_lang.ir.nodes import Stage

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
HF_WRT = {"w_o", "w_13", "w_2", "w_qkv", "w_lm", "g", "g1", "g2", "go", "gd", "gq", "gk", "gqk"}
HF_WRT |= {"h", "y", "x", "hg", "r"}
TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}


def _programs() -> list[tuple[str, str, bool]]:
    out = [
        ("llama", model_source("bfloat16", 1e-5, 8, False), True),
        ("qwen3", model_source("bfloat16", 1e-6, 8, True), True),
        # OLMo 2: the post norms' row stages, the q/k norm over each projection's row stage
        (
            "olmo2",
            model_source("bfloat16", 1e-6, 8, "proj", pre_norm=False, post_norm=True, heads=(4, 2)),
            True,
        ),
        # Gemma 2: the sandwich's row stages with norms of 1 + w, GeGLU, the logits soft-capped
        (
            "gemma2",
            model_source(
                "bfloat16",
                1e-6,
                8,
                None,
                post_norm=True,
                norm_offset=1.0,
                act="gelu_pytorch_tanh",
                softcap=30.0,
            ),
            True,
        ),
        # Gemma 3: heads of 256 (every released one), whose per-head q/k norm (of 1 + w) completes in
        # a row stage: its backward's grouped reductions over groups of 256 columns (128 pairs)
        (
            "gemma3",
            model_source(
                "bfloat16",
                1e-6,
                256,
                "head",
                post_norm=True,
                norm_offset=1.0,
                act="gelu_pytorch_tanh",
                softcap=30.0,
            ),
            True,
        ),
    ]
    for f in sorted(glob.glob(str(ROOT / "examples" / "*.coda"))):
        out.append((Path(f).stem, Path(f).read_text(), False))
    # programs `coda fuzz --programs` found failing (min_half_width_special.coda: its min backward's
    # stage, [M, 2*N] over [M, N] tiles, pairs no columns; the generated kernel got it wrong, on the
    # H100 and on Triton's interpreter; such a stage is now left to torch.compile)
    for f in sorted(glob.glob(str(ROOT / "tests" / "fuzz_found" / "*.coda"))):
        out.append((f"found.{Path(f).stem}", Path(f).read_text(), False))
    return out


def _blocks() -> dict[str, tuple[str, str, dict[str, Any] | None]]:
    """Every block of the programs whose elementwise stages are tested, and its backwards, by prefix
    ("program.block.tag"): (program, block, the keywords of its `grad`; None: the block itself)."""
    out: dict[str, tuple[str, str, dict[str, Any] | None]] = {}
    for prog_name, _src, hf in _programs():
        prog = _program(prog_name)
        for bn in prog.blocks:
            b = prog[bn]
            blocks: list[tuple[str, dict[str, Any] | None]] = [("fwd", None)]
            blocks += [] if bn in NO_BACKWARD else [("bwd", {})]
            if prog_name.startswith("found."):  # (as the fuzzer found them: under --remat save too)
                blocks.append(("bwd_save", {"remat": "save"}))
            if hf:
                wrt = [p.var.name for p in b.ir.params if p.var.name in HF_WRT]
                blocks.append(("bwd_hf", {"wrt": wrt}))
                # the loss head of "rows" mode saves its logits: its backward's elementwise stage
                # picks the target's column with col_index()
                blocks.append(("bwd_hf_save", {"wrt": wrt, "remat": "save"}))
            for tag, grad in blocks:
                out[f"{prog_name}.{bn}.{tag}"] = (prog_name, bn, grad)
    return out


@functools.cache
def _program(name: str) -> Any:
    return coda_lang.load(next(src for n, src, _ in _programs() if n == name))


@functools.cache
def elementwise_stages(prefix: str) -> list[tuple[str, ElementwiseStage]]:
    """(id, stage) for every elementwise stage of one of BLOCKS (derived here, once per process)."""
    prog_name, bn, grad = BLOCKS[prefix]
    blk = _program(prog_name)[bn]
    blk = blk if grad is None else blk.grad(**grad)
    stages = [s for s in blk.ir.body if isinstance(s, Stage)]
    return [
        (f"{prefix}.{i}", ElementwiseStage(blk, i, emulate=True))
        for i, s in enumerate(stages, 1)
        if s.a is None
    ]


def stage(name: str) -> ElementwiseStage:
    """The elementwise stage `name` ("program.block.tag.index")."""
    return dict(elementwise_stages(name.rsplit(".", 1)[0]))[name]


BLOCKS = _blocks()


def _row_size(st: ElementwiseStage) -> int:
    """The size of the stage's row dim that gives the generated kernel a few row blocks of BM rows, the
    last one ragged where BM > 1 (32 or 4 rows with a reduction over the rows, whose partials are
    folded across the programs): BM + 5 rows or just over. Triton's interpreter runs the programs one
    by one, and with BM 1 (each program one row) the rows past a few cost seconds and reach no other
    code."""
    bm = TritonStage(st, interpret=True).bm
    coeff = st.rows.coeff
    n = max(1, math.ceil((bm + 5) / coeff))
    while (coeff * n).denominator != 1 or (bm > 1 and (coeff * n) % bm == 0):
        n += 1
    return n


def _sizes(st: ElementwiseStage) -> dict[str, int]:
    """Dim sizes that are multiples of no block: a few row blocks of the kernel's programs, the last
    one ragged where a block has more than one row (`_row_size`: 37 rows where it has 32, 9 where 4, 6
    where 1); odd numbers of column pairs."""
    sizes = {}
    fixed = {d.name: int(d.value) for d in st.block.ir.dims if d.value is not None}
    base = {"M": 37, "D": 150, "F": 134, "K": 146, "P": 136, "V": 300, "N": 262, "H": 2}
    names = set()
    for prm in st.block.ir.params:
        for d in getattr(prm.var.type, "shape", ()) or ():
            if d.name is not None:
                names.add(d.name)
    for n in names:
        sizes[n] = fixed.get(n, base.get(n, 134))
    rows = st.rows.name
    if rows in sizes and rows not in fixed and rows != st.cols.name and unsupported(st) is None:
        sizes[rows] = _row_size(st)
    sizes.update(fixed)  # (a fixed dim a stage refers to: a group's HD)
    # a grouped reduction's row holds whole groups: the stage's columns a multiple of the group (N: 272,
    # 17 groups of 16: two chunks of 128 columns and a ragged one)
    g = max((info["group"] for *_x, info in st.steps if info.get("group")), default=0)
    c = st.cols
    if g and c.name is not None and c.name not in fixed:
        while (c.coeff * sizes[c.name]) % g or c.coeff * sizes[c.name] < 3 * g:  # three groups or more
            sizes[c.name] += 1
    return sizes


def _extent(d: Any, sizes: dict[str, int]) -> int:
    n = d.coeff * (sizes[d.name] if d.name is not None else 1)
    assert n.denominator == 1
    return int(n)


def _inputs(st: ElementwiseStage, sizes: dict[str, int], gen: torch.Generator) -> list[Any]:
    ins: list[Any] = []
    for ld in st.loads:
        shape = tuple(_extent(d, sizes) for d in ld.shape)
        if ld.role == "scalar":
            ins.append(0.25)
            continue
        if ld.dtype == "i32":
            ins.append(torch.randint(-1, 7, shape, generator=gen, dtype=torch.int32))
            continue
        x = torch.randn(shape, generator=gen)
        if ld.role == "row vector":
            x = x.abs() + 0.5  # row scales (rsqrt's results) are positive in the programs
        ins.append(x.to(TORCH[ld.dtype]))
    return ins


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape, g.dtype, w.dtype)
        g64, w64 = g.double(), w.double()
        assert torch.equal(torch.isnan(g64), torch.isnan(w64)), (what, i, "NaN positions differ")
        fin = torch.isfinite(w64)
        assert torch.equal(g64[~fin & ~torch.isnan(w64)], w64[~fin & ~torch.isnan(w64)]), (
            what,
            i,
            "infinities",
        )
        scale = float(w64[fin].abs().max()) if fin.any() else 1.0
        if g.dtype in (torch.bfloat16, torch.float16):
            # one unit in the last place of the stored dtype (f32 differences in the math before the
            # rounding may flip it), plus f32 noise at the output's scale (cancellation)
            eps = 2.0**-7 if g.dtype == torch.bfloat16 else 2.0**-10
            tol = eps * w64[fin].abs() + 1e-5 * scale
        else:
            tol = 1e-5 * scale + 1e-6
        err = (g64[fin] - w64[fin]).abs()
        assert bool((err <= tol).all()), (what, i, float((err - tol).max()), scale)


def _costly(name: str) -> bool:
    """Qwen3's, OLMo 2's and Gemma 2's and 3's stages beyond their layer block's forward and the
    patch's backward of it (the first layer's and the last's are the same kinds of stage; the other
    backwards, the heads' are Llama's or its soft-capped ones), and Llama's other backwards of the
    blocks the patch differentiates (the same stages' kinds), run under -m slow."""
    if any(
        name.startswith(f"{f}.") and not name.startswith((f"{f}.layer.fwd.", f"{f}.layer.bwd_hf."))
        for f in ("qwen3", "olmo2", "gemma2", "gemma3")
    ):
        return True
    # Llama's blocks differentiated for every parameter (`bwd`) and under remat="save" (`bwd_hf_save`),
    # beside the patch's own backward of each (`bwd_hf`), but the loss heads' saved-logits stages
    return name.startswith(
        tuple(
            f"llama.{b}.{tag}."
            for b in ("first_qkv", "layer", "last", "head_logits")
            for tag in ("bwd", "bwd_hf_save")
        )
    )


def _whole(prefix: str) -> bool:
    """A costly backward (`_costly`, -m slow): tested as one case per block, its stages found when the
    case runs (deriving those backwards is most of the seconds it took to list every stage each time
    the file was collected, in each xdist worker). Every other block's stages are listed one by one."""
    return BLOCKS[prefix][2] is not None and _costly(f"{prefix}.")


# the stages the generator takes, one by one: every block's, but the costly backwards' (derived when
# the file is collected), then those backwards by block (derived when their cases run)
CASES: list[str] = []
for _p in BLOCKS:
    CASES += [_p] if _whole(_p) else [n for n, st in elementwise_stages(_p) if unsupported(st) is None]
SUPPORTED = [c for c in CASES if c not in BLOCKS]


def each_supported(case: str, check: Any) -> None:
    """check(name, stage) for a stage of SUPPORTED; for a costly backward's block, for each of its
    stages the generator takes (every one checked, the failures reported together), skipped where it
    takes none."""
    if case not in BLOCKS:
        check(case, stage(case))
        return
    stages = [(n, st) for n, st in elementwise_stages(case) if unsupported(st) is None]
    if not stages:
        pytest.skip(f"{case}: no elementwise stage the generator takes")
    failed = []
    for n, st in stages:
        try:
            check(n, st)
        except AssertionError as e:
            failed.append(f"{n}: {e!r}")
    assert not failed, "\n".join(failed)


def test_the_generator_takes_the_stages_the_llama_step_runs() -> None:
    names = set(SUPPORTED)
    # RoPE's backward at the entry of the layer's and the first layer's backward, the last block's
    # norm backward (a reduction over the rows), the first block's forward norm statistics
    for need in (
        "llama.layer.bwd_hf.1",
        "llama.first_qkv.bwd_hf.1",
        "llama.last.bwd_hf.1",
        "llama.first_qkv.fwd.1",
    ):
        assert need in names, sorted(names)
    assert len(SUPPORTED) >= 12


def _interpreted(name: str, st: ElementwiseStage) -> None:
    sizes = _sizes(st)
    rows = _extent(st.rows, sizes)
    cols = _extent(st.cols, sizes)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    ins = _inputs(st, sizes, gen)
    want = st._body(rows, cols, sizes, torch.device("cpu"), *ins)
    got = TritonStage(st, interpret=True)(rows, cols, sizes, torch.device("cpu"), *ins)
    assert_same(got, want, name)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c, marks=[pytest.mark.slow] if _costly(f"{c}.") else []) for c in CASES]
)
def test_generated_kernel_matches_the_torch_function(case: str) -> None:
    each_supported(case, _interpreted)


def test_refused_stages_say_why() -> None:
    # Qwen3's per-head q/k-norm backward (grouped sums, a head_dim vector repeating across the heads)
    # and the example's are generated now
    for name in (
        "qwen3.layer.bwd_hf.1",
        "qk_norm.qk_norm.bwd.1",
        "found.head_norm_row_scale.head_norm.bwd.1",
    ):
        why = unsupported(stage(name))
        assert why is None, (name, why)
    # a group a chunk can't hold whole (12 columns: chunks are powers of two)
    odd = ElementwiseStage(coda_lang.load(_grouped_src(False, group=12))["gsum"], 1, emulate=True)
    assert "a group of 12 columns" in (unsupported(odd) or "")
    with pytest.raises(AssertionError):
        TritonStage(odd, interpret=True)
    # half-width tiles in a stage that pairs no columns (the found program's min backward)
    assert "pairs no columns" in (unsupported(stage("found.min_half_width_special.fwd.bwd_save.1")) or "")


HAND = """dims M, N

block b(x: bf16[M, N], s: f32[M], v: f32[N/2], a: f32, k: f32 = 3.0, j: i32[M]) -> (y: bf16[M, N], q: f32[M, N/2], z: f16[M, N], ci: f32[M, N]) {
  elementwise [M, N] {
    u, w = pairs(x)
    t = max(u * v, w) * a - k
    y: bf16 = interleave(t, cast(w * s, bf16))
    q = min(u, w) + s
    z: f16 = x * s - 1.0
    ci = where(col_index() >= row_index(), x, 0.0) + where(col_index() == j, 100.0, 0.0)
    hi = max(x * s, over=N)
    lo = min(x, over=M)
    tot = sum(x / s, over=M)
    top = max(t, over=N/2)
  }
}
"""


@pytest.mark.parametrize("scalar_as_tensor", [False, True])
def test_max_min_nan_inf_cast_scalars(scalar_as_tensor: bool) -> None:
    blk = coda_lang.load(HAND)["b"]
    st = ElementwiseStage(blk, 1, emulate=True)
    assert unsupported(st) is None
    rows, cols = 13, 2 * 133  # (programs of 4 rows, the stage reducing over them: the last ragged)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, cols, generator=gen)
    x[3, 7] = float("nan")
    x[5, 10] = float("inf")
    x[6, 11] = float("-inf")
    named = {
        "x": x.bfloat16(),
        "s": torch.rand(rows, generator=gen) + 0.5,
        "v": torch.randn(cols // 2, generator=gen),
        "a": torch.tensor(1.5) if scalar_as_tensor else 1.5,
        "k": torch.tensor(3.0) if scalar_as_tensor else 3.0,
        "j": torch.randint(-1, cols + 1, (rows,), generator=gen, dtype=torch.int32),
    }
    ins = [named[n] for n, _ in st.roles]
    sizes = {"M": rows, "N": cols}
    want = st._body(rows, cols, sizes, torch.device("cpu"), *ins)
    with np.errstate(all="ignore"):  # inf / inf in the interpreter's NumPy, as in the torch function
        got = TritonStage(st, interpret=True)(rows, cols, sizes, torch.device("cpu"), *ins)
    assert_same(got, want, "hand")
    # the NaN reached the max over its row and the min over its column
    hi = got[len(st.store_meta) + st.reductions.index("hi")]
    lo = got[len(st.store_meta) + st.reductions.index("lo")]
    assert torch.isnan(hi[3]) and not torch.isnan(hi[4])
    assert torch.isnan(lo[7]) and torch.isneginf(lo[11])
    # row_index()/col_index() in a paired stage: each lane its own column (a causal mask, a one-hot)
    ci = got[[n for n, *_ in st.store_meta].index("ci")]
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    xb = named["x"].float()
    want_ci = torch.where(c >= r, xb, 0.0) + torch.where(c == named["j"][:, None], 100.0, 0.0)
    torch.testing.assert_close(ci, want_ci, rtol=0, atol=0, equal_nan=True)


def _grouped_src(paired: bool, group: int = 16) -> str:
    """Per-head sums used in their stage: an RMSNorm over groups of `group` columns scaling its own
    columns, a max over groups of 8 subtracted from them, a row sum of what they made; `paired`: the
    stage also pairs columns (its chunks are of column pairs, each group in both lanes)."""
    outs, more = (", p: bf16[M, 2*P]", "    u, v = pairs(x)\n    p: bf16 = interleave(u * v, v - u)\n")
    if not paired:
        outs, more = "", ""
    return f"""dims M, P

block gsum(x: bf16[M, 2*P], w: f32[2*P]) -> (y: bf16[M, 2*P], z: bf16[M, 2*P]{outs}) {{
  elementwise [M, 2*P] {{
    s16 = sum(x * x, over=2*P, group={group})
    y: bf16 = x * rsqrt(s16 / {float(group)} + 0.000001) * w
    s8 = max(x * w, over=2*P, group=8)
    z: bf16 = x - s8
    t = sum(z * y, over=2*P)
{more}  }}
}}
"""


@pytest.mark.parametrize("paired", [False, True])
def test_grouped_reductions_used_in_their_stage(paired: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    blk = coda_lang.load(_grouped_src(paired))["gsum"]
    st = ElementwiseStage(blk, 1, emulate=True)
    assert unsupported(st) is None and st.groups == (16, 8, 0)
    # 2 * 136 columns: two chunks of 128 and a ragged one (unpaired), or a chunk of 128 pairs and one
    # of 8 (paired); 17 groups of 16. A program a row (Triton's interpreter runs them one by one)
    rows, cols = 6, 2 * 136
    gen = torch.Generator().manual_seed(5)
    ins = [torch.randn(rows, cols, generator=gen).bfloat16(), torch.randn(cols, generator=gen)]
    sizes = {"M": rows, "P": cols // 2}
    want = st._body(rows, cols, sizes, torch.device("cpu"), *ins)
    ts = TritonStage(st, interpret=True)
    assert "tl.reshape" in ts.source(())
    got = ts(rows, cols, sizes, torch.device("cpu"), *ins)
    assert_same(got, want, f"grouped paired={paired}")
    k = len(st.store_meta)
    assert got[k].shape == (rows, cols // 16) and got[k + 1].shape == (rows, cols // 8)
    # a mutant: the kernel's groups twice as wide as the program's (its stores stay in the buffers)
    real = generate._group_units
    monkeypatch.setattr(generate, "_group_units", lambda st, info: real(st, info) * 2)
    with np.errstate(all="ignore"):  # (the buffers' unwritten groups)
        bad = TritonStage(st, interpret=True)(rows, cols, sizes, torch.device("cpu"), *ins)
    with pytest.raises(AssertionError):
        assert_same(bad, want, "mutant")


def test_function_uses_the_generated_kernel_off_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    st = stage("llama.layer.bwd_hf.1")
    monkeypatch.delenv("CODA_ELEMENTWISE", raising=False)
    off = ElementwiseStage(st.block, st.index, emulate=False)
    assert off.generator == "triton" and isinstance(off.function(), TritonStage)
    monkeypatch.setenv("CODA_ELEMENTWISE", "inductor")
    off = ElementwiseStage(st.block, st.index, emulate=False)
    assert off.generator == "inductor" and not isinstance(off.function(), TritonStage)
    monkeypatch.delenv("CODA_ELEMENTWISE")
    grouped = stage("qwen3.layer.bwd_hf.1")
    assert ElementwiseStage(grouped.block, grouped.index, emulate=False).generator == "triton"
    refused = stage("found.min_half_width_special.fwd.bwd.1")
    assert ElementwiseStage(refused.block, refused.index, emulate=False).generator == "inductor"
    # emulated: the eager torch function, whatever the setting
    emulated = ElementwiseStage(st.block, st.index, emulate=True)
    assert emulated.function() == emulated._body
    # the generated kernel given CPU tensors (no GPU to launch on) runs the eager function
    sizes = _sizes(st)
    rows, cols = _extent(st.rows, sizes), _extent(st.cols, sizes)
    ins = _inputs(st, sizes, torch.Generator().manual_seed(1))
    got = TritonStage(st)(rows, cols, sizes, torch.device("cpu"), *ins)
    assert_same(got, st._body(rows, cols, sizes, torch.device("cpu"), *ins), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_compiled_kernel_on_the_gpu(case: str) -> None:
    """The compiled kernel (libdevice math, the GPU's conversions) against the torch function on the
    same GPU inputs, at the test's sizes and at 8192 rows with 3072 columns where the stage allows."""
    each_supported(case, _compiled)


def _compiled(name: str, st: ElementwiseStage) -> None:
    dev = torch.device("cuda")
    for big in (False, True):
        sizes = _sizes(st)
        if big:
            sizes = {k: (8192 if k == "M" else 1536 if k == "P" else v) for k, v in sizes.items()}
        rows, cols = _extent(st.rows, sizes), _extent(st.cols, sizes)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        ins = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in _inputs(st, sizes, gen)]
        want = st._body(rows, cols, sizes, dev, *ins)
        got = TritonStage(st)(rows, cols, sizes, dev, *ins)
        torch.cuda.synchronize()
        assert_same(tuple(g.cpu() for g in got), tuple(w.cpu() for w in want), f"{name} big={big}")


def test_the_loss_heads_dlogits_are_stored_over_its_logits() -> None:
    """The loss head of "rows" mode saves its logits (acc1, bf16) for its backward, whose elementwise
    stage stores dlogits (dacc1, bf16, the same shape): a run that may consume acc1 (its forward made
    it for this chunk alone) hands acc1's buffer to the generated kernel as dacc1's, which loads every
    element before it stores there; the result is the eager function's, in that buffer. With 1030
    vocabulary columns the kernel takes its wide chunks (1024 columns, a ragged second one)."""
    st = stage("llama.head_loss_rows.bwd_hf_save.1")
    cb = st.block.cuda(emulate=True)
    es = cb.elementwise[1]
    i = next(k for k, s in enumerate(st.block.ir.body) if isinstance(s, Stage))
    sizes = {**_sizes(st), "V": 1030}
    ins = _inputs(st, sizes, torch.Generator().manual_seed(4))
    env = {ld.name: x for ld, x in zip(es.loads, ins, strict=True)}
    assert cb.liveness.into_loads(es, i, env, frozenset()) is None  # nothing consumable
    over = cb.liveness.into_loads(es, i, env, frozenset({"acc1"}))
    assert over is not None and set(over) == {"dacc1"} and over["dacc1"] is env["acc1"]
    rows, cols = _extent(st.rows, sizes), _extent(st.cols, sizes)
    want = st._body(
        rows,
        cols,
        sizes,
        torch.device("cpu"),
        *[x.clone() if isinstance(x, torch.Tensor) else x for x in ins],
    )
    buf = env["acc1"]
    ts = TritonStage(st, interpret=True)
    assert cols >= ts.bc_wide == 1024
    got = ts(rows, cols, sizes, torch.device("cpu"), *ins, into=[over.get(n) for n, _, _ in es.stores])
    k = [n for n, *_ in st.store_meta].index("dacc1")
    assert got[k].data_ptr() == buf.data_ptr()
    assert_same(got, want, "dlogits over logits")


# -- fp8 stores: the generated kernel's store against the interpreter's (core/numerics.round_fp8), bit
# for bit. The motivating stage quantizes a weight with its delayed scale and takes its amax.
FP8_STAGES = {
    "e4m3": """dims R, C
block q(w: bf16[R, C], s: f32) -> (wq: e4m3[R, C], am: f32) {
  elementwise [R, C] {
    wq: e4m3 = w * s
    amp = max(abs(w), over=C)
  }
  am = detach(max(amp, over=R))
}
""",
    "e5m2": """dims R, C
block q(w: f32[R, C], s: f32) -> (wq: e5m2[R, C], am: f32) {
  elementwise [R, C] {
    wq: e5m2 = w * s
    amp = max(abs(w), over=C)
  }
  am = detach(max(amp, over=R))
}
""",
    "both": """dims R, C
block q(w: f32[R, C], s: f32, t: f32) -> (a: e4m3[R, C], b: e5m2[R, C], am: f32) {
  elementwise [R, C] {
    a: e4m3 = w * s
    b: e5m2 = w * t
    amp = max(abs(w), over=C)
  }
  am = detach(max(amp, over=R))
}
""",
}
FP8_ML = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}
# the scales: powers of two (w = probe / s: the products are the probe values exactly), and others
# (the products near them, rounded in f32)
FP8_SCALES = (1.0, 2.0**-4, 2.0**6, 3.7, 0.01)


def _fp8_grid(ml: Any) -> np.ndarray:
    """The fp8 dtype's finite values >= 0, ascending (float64)."""
    v = np.arange(256, dtype=np.uint8).view(ml).astype(np.float64)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def _fp8_probe() -> np.ndarray:
    """f32 values that reach every finite code of both fp8 dtypes, the midpoints between neighbours
    (ties: to even), the f32 values next to each, the overflow boundary and beyond the largest value,
    subnormals and what rounds to 0 (half the smallest subnormal: a tie), f32's own extremes, random
    magnitudes from 1e-8 to 1e6, infinities, NaN and zero; both signs."""
    pts: list[Any] = []
    for ml in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        v = _fp8_grid(ml)
        mx = float(ml_dtypes.finfo(ml).max)
        top = v[-1] + (v[-1] - v[-2]) / 2  # where a cast that does not saturate overflows
        pts += [v, (v[1:] + v[:-1]) / 2, [top, mx * 1.01, mx * 2, v[1] / 2, v[1] / 3, v[1] * 0.75]]
    f32 = np.finfo(np.float32)
    pts.append([1e30, float(f32.max), float(f32.smallest_subnormal), float(f32.smallest_normal)])
    p = np.concatenate([np.asarray(x, np.float64) for x in pts]).astype(np.float32)
    with np.errstate(over="ignore"):  # (next to f32's largest value: inf)
        up, down = np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(-np.inf))
    rng = np.random.default_rng(8)
    rand = (rng.standard_normal(1000) * 10.0 ** rng.uniform(-8, 6, 1000)).astype(np.float32)
    x = np.concatenate([p, up, down, rand, np.array([np.inf, np.nan, 0.0], np.float32)])
    return np.concatenate([x, -x])


def _fp8_inputs(kind: str, s: float, rows: int, cols: int, device: str = "cpu") -> dict[str, Any]:
    """The stage's inputs: w = probe / s laid out over [rows, cols] (the rest of it random), in w's
    dtype; the scales as a number (s) and as a tensor (t)."""
    probe = _fp8_probe()
    n = rows * cols
    gen = torch.Generator().manual_seed(11)
    fill = torch.randn(n, generator=gen) * 10.0 ** (torch.rand(n, generator=gen) * 8 - 4)
    fill[: len(probe)] = torch.from_numpy(probe)
    with np.errstate(all="ignore"):
        w = (fill / s).reshape(rows, cols)
    w = w.bfloat16() if kind == "e4m3" else w
    ins: dict[str, Any] = {"w": w.to(device), "s": s}
    if kind == "both":
        ins["t"] = torch.tensor(s, device=device)
    return ins


def _interp_inputs(ins: dict[str, Any]) -> dict[str, Any]:
    """The same inputs for the reference interpreter (NumPy; bf16 as ml_dtypes.bfloat16)."""
    out: dict[str, Any] = {}
    for k, v in ins.items():
        if isinstance(v, torch.Tensor) and v.dim():
            a = v.float().cpu().numpy()
            out[k] = a.astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else a
        else:
            out[k] = np.float32(float(v))
    return out


def assert_fp8_bits(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    """An fp8 tile the kernel stored against the interpreter's, code for code; a NaN against a NaN
    (its code aside: the GPU's conversion writes one NaN, ml_dtypes keeps the sign)."""
    assert got.dtype in FP8_ML and want.dtype == FP8_ML[got.dtype], (what, got.dtype, want.dtype)
    assert tuple(got.shape) == want.shape, (what, got.shape, want.shape)
    g = got.cpu().view(torch.uint8).numpy()
    w = want.view(np.uint8)
    gnan = torch.isnan(got.cpu().float()).numpy()
    wnan = np.isnan(want.astype(np.float32))
    assert np.array_equal(gnan, wnan), (what, "NaN positions differ")
    bad = np.flatnonzero(g[~wnan] != w[~wnan])
    assert bad.size == 0, (what, bad.size, g[~wnan][bad[:8]], w[~wnan][bad[:8]])


def _fp8_stage(kind: str) -> tuple[Any, ElementwiseStage]:
    blk = coda_lang.load(FP8_STAGES[kind])["q"]
    return blk, ElementwiseStage(blk, 1, emulate=True)


def _codes_reached(want: np.ndarray) -> set[int]:
    w = want.view(np.uint8)
    return set(np.unique(w[~np.isnan(want.astype(np.float32))]).tolist())


def _finite_codes(ml: Any) -> set[int]:
    c = np.arange(256, dtype=np.uint8)
    return set(c[np.isfinite(c.view(ml).astype(np.float32))].tolist())


@pytest.mark.parametrize("s", FP8_SCALES)
@pytest.mark.parametrize("kind", list(FP8_STAGES))
def test_fp8_stores_match_the_interpreter(kind: str, s: float) -> None:
    """The generated kernel (Triton's CPU interpreter: its store rounds to the fp8 grid in f32 and
    assembles the code from the bits, NaN's too) in the emulated runtime against the
    interpreter's block, bit for bit, NaN included: every finite code of each stored dtype reached
    (powers-of-two scales), midpoints, saturation, subnormals, signed zeros, infinities. The
    motivating stage over 1030 columns (a wide chunk of 1024 and a ragged one), the others 320."""
    blk, st = _fp8_stage(kind)
    assert unsupported(st) is None
    cols = 1030 if kind == "e4m3" else 320
    rows = -(-len(_fp8_probe()) // cols)
    ins = _fp8_inputs(kind, s, rows, cols)
    cb = blk.cuda(emulate=True)
    es = cb.elementwise[1]
    es._fn = TritonStage(es, interpret=True)  # the generated kernel where the emulator runs the eager one
    with np.errstate(all="ignore"):
        got = cb(ins)
        want = blk.run(_interp_inputs(ins))
    assert set(got) == set(want)
    for name, dtype, _w in st.store_meta:
        assert got[name].dtype == dtype, (name, got[name].dtype)
        assert_fp8_bits(got[name], want[name], f"{kind} s={s} {name}")
        if math.log2(s).is_integer():
            assert _codes_reached(want[name]) >= _finite_codes(FP8_ML[dtype]), name
    # the amax (NaN: the probe holds one)
    assert torch.isnan(got["am"]) and np.isnan(want["am"])


def test_fp8_stores_round_to_nearest_even_and_saturate() -> None:
    """What the interpreter path's rounding does, without the interpreter as the reference: the ties
    between neighbours go to the even code, past the largest value (infinities too) to +-max, half the
    smallest subnormal to a signed 0, NaN to NaN."""
    blk, st = _fp8_stage("both")
    for dtype, name in ((torch.float8_e4m3fn, "a"), (torch.float8_e5m2, "b")):
        ml = FP8_ML[dtype]
        v = _fp8_grid(ml)
        mx = float(v[-1])
        lo, hi = v[1:-1], v[2:]
        mids = (lo + hi) / 2
        x = np.concatenate([mids, [mx * 1.5, np.inf, v[1] / 2, 0.0, np.nan]]).astype(np.float32)
        x = np.concatenate([x, -x])
        w = torch.from_numpy(x).reshape(1, -1)
        got = TritonStage(st, interpret=True)(
            1, w.shape[1], {"R": 1, "C": w.shape[1]}, torch.device("cpu"), w, 1.0, torch.tensor(1.0)
        )[[n for n, *_ in st.store_meta].index(name)]
        g = got.float().reshape(-1).numpy().astype(np.float64)
        codes = got.view(torch.uint8).reshape(-1).numpy()
        k = len(mids)
        # each midpoint went to whichever neighbour has the even code (the codes ascend with the values)
        even_lo = (np.arange(1, len(v) - 1) % 2) == 0
        assert np.array_equal(g[:k], np.where(even_lo, lo, hi)), name
        assert np.array_equal(codes[:k] % 2, np.zeros(k)), name
        assert g[k : k + 2].tolist() == [mx, mx] and g[k + 2] == 0.0 and g[k + 3] == 0.0
        assert np.isnan(g[k + 4]) and np.isnan(g[-1])
        assert np.array_equal(g[len(x) // 2 :][: k + 4], -g[: k + 4]) and codes[len(x) // 2 + k + 2] == 0x80


def test_fp8_stores_are_generated_and_fp8_loads_are_not() -> None:
    """A stage that stores fp8 tiles is a generated kernel (on the GPU: the clamp, NaN kept, then
    Triton's own conversion, rounding to nearest even); one that loads an fp8 tile or casts to fp8
    inside still keeps torch.compile."""
    for kind in FP8_STAGES:
        blk, st = _fp8_stage(kind)
        assert unsupported(st) is None, kind
        assert ElementwiseStage(blk, 1, emulate=False).generator == "triton"
        scalar_tensors = tuple(n == "t" for n, role in st.roles if role == "scalar")
        gpu = TritonStage(st).source(scalar_tensors)
        for _name, dtype, _w in st.store_meta:
            tl_dtype, mx = {
                torch.float8_e4m3fn: ("tl.float8e4nv", 448.0),
                torch.float8_e5m2: ("tl.float8e5", 57344.0),
            }[dtype]
            assert f"tl.where(x != x, x, tl.minimum(tl.maximum(x, {-mx!r}), {mx!r}))" in gpu
            assert f'.to({tl_dtype}, fp_downcast_rounding="rtne")' in gpu
            assert f"{tl_dtype}, bitcast=True" not in gpu  # (the interpreter's path only)
    loads = """dims M, N
block f(x: e4m3[M, N], s: f32) -> (y: bf16[M, N]) {
  elementwise [M, N] {
    y: bf16 = x * s
  }
}
"""
    st = ElementwiseStage(coda_lang.load(loads)["f"], 1, emulate=True)
    assert "`x` is e4m3" in (unsupported(st) or "")
    casts = """dims M, N
block f(x: bf16[M, N], s: f32) -> (y: bf16[M, N]) {
  elementwise [M, N] {
    y: bf16 = cast(x * s, e5m2) / s
  }
}
"""
    st = ElementwiseStage(coda_lang.load(casts)["f"], 1, emulate=True)
    assert "a cast to e5m2" in (unsupported(st) or "")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(FP8_STAGES))
def test_fp8_stores_on_the_gpu(kind: str) -> None:
    """The compiled kernel's fp8 stores (the GPU's conversion) against the interpreter bit for bit,
    NaN included, at every scale on the probe's shape, and at [16384, 2048] (wide chunks) at one."""
    blk, st = _fp8_stage(kind)
    dev = torch.device("cuda")
    ts = TritonStage(st)
    cols = 1030 if kind == "e4m3" else 320
    rows = -(-len(_fp8_probe()) // cols)
    for s, (r, c) in [*((s, (rows, cols)) for s in FP8_SCALES), (3.7, (16384, 2048))]:
        ins = _fp8_inputs(kind, s, r, c, device="cuda")
        args = [ins[n] for n, _ in st.roles]
        got = ts(r, c, {"R": r, "C": c}, dev, *args)
        torch.cuda.synchronize()
        with np.errstate(all="ignore"):
            want = blk.run(_interp_inputs(ins))
        for i, (name, dtype, _w) in enumerate(st.store_meta):
            assert got[i].dtype == dtype and got[i].device.type == "cuda"
            assert_fp8_bits(got[i], want[name], f"{kind} s={s} [{r}, {c}] {name}")
        amp = got[len(st.store_meta)]
        assert torch.isnan(amp.max()) and np.isnan(want["am"])


@pytest.mark.gpu
def test_fp8_quantize_block_on_the_gpu() -> None:
    """The motivating block through the CUDA runtime (its stage the generated kernel, its amax folded
    between stages) against the interpreter, the scale as a number and as a tensor."""
    blk, _st = _fp8_stage("e4m3")
    cb = blk.cuda()
    assert cb.elementwise[1].generator == "triton"
    for s in (3.7, torch.tensor(2.0**-4, device="cuda")):
        sv = float(s)
        ins = _fp8_inputs("e4m3", sv, 4096, 2048, device="cuda")
        ins["s"] = s
        got = cb(ins)
        torch.cuda.synchronize()
        with np.errstate(all="ignore"):
            want = blk.run(_interp_inputs(ins))
        assert_fp8_bits(got["wq"], want["wq"], f"block s={sv}")
        assert torch.isnan(got["am"]) and np.isnan(want["am"])
        # without the NaN the amax is the interpreter's
        w = ins["w"].clone()
        w[torch.isnan(w)] = 0.0
        ins["w"] = w
        got = cb(ins)
        with np.errstate(all="ignore"):
            want = blk.run(_interp_inputs(ins))
        assert float(got["am"]) == float(want["am"])
        assert_fp8_bits(got["wq"], want["wq"], f"block s={sv} no NaN")
