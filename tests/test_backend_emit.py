"""The CuTeDSL backend without compiling: stage planning, emitted epilogue source, E07 diagnostics, CLI.

- Golden files: tests/golden/emit/<block>_stage<k>.py hold the emitted source of llama_mlp's stages
  and of qk_norm's (a prepass for its per-head grouped sum; compared exactly; `pytest --update-golden`
  rewrites them).
- Every example's stages either emit valid Python or stop with a clean E07 diagnostic; so does every
  GEMM stage of the OLMo 2 program coda_lang.hf generates (and its backwards), its row stages the
  Triton generator's.
- Each E07 code the planner gives is produced by a small program, at the offending line.
- `import coda_lang, coda_lang.cli` (and the backend's planning modules) import no GPU library.
- `coda compile --emit source`: one file per stage, exit codes 0/1/2, no traceback.
None of this needs quack, CuTeDSL or a GPU; tests/test_backend_ptx.py compiles.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from support import coda, golden

import coda_lang
from coda_lang.backend_cute.build.store import write_source
from coda_lang.backend_cute.plan.emit import EMITTER_VERSION, emit_stage, module_name
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.core.diagnostics import CodaError
from coda_lang.ops import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.coda"))
GOLDEN = ROOT / "tests" / "golden" / "emit"
MLP = ROOT / "examples" / "llama_mlp.coda"
HEAVY = ("cutlass", "quack", "triton", "torch")


def mlp() -> coda_lang.Block:
    return coda_lang.load(MLP)["llama_mlp"]


@pytest.mark.parametrize("name,index", [("llama_mlp", 1), ("llama_mlp", 2), ("llama_mlp", 3), ("qk_norm", 1)])
def test_golden(name: str, index: int, update_golden: bool) -> None:
    source = emit_stage(plan_stage(coda_lang.load(ROOT / "examples" / f"{name}.coda")[name], index))
    golden(GOLDEN / f"{name}_stage{index}.py", source, update_golden)


def test_llama_mlp_plans_like_the_hand_written_epilogues() -> None:
    """Stage 1 is quack's rms_partial_epi (residual tile, weight row vector, D = h*g, stored h, scaled
    sum of squares); stage 2 is rstd_swiglu (row scale, acc_pair, gated half-width output, no D);
    stage 3 is residual_epi."""
    s1, s2, s3 = (plan_stage(mlp(), k) for k in (1, 2, 3))
    assert s1.mode == "element"
    assert [(o.name, o.op, o.dtype) for o in s1.operands] == [
        ("x", "TileLoad", "bf16"),
        ("g", "RowVecLoad", "f32"),
    ]
    assert s1.d is not None and (s1.d.name, s1.d.dtype) == ("hg", "bf16")
    assert [(o.name, o.gated) for o in s1.outputs] == [("h", False)]
    assert [(s.name, s.op, s.combine, s.scaled, s.value) for s in s1.sinks] == [
        ("ss", "ColVecReduce", "add", True, ("h", "h"))
    ]
    assert s2.mode == "acc_pair" and s2.d is None
    assert [(o.name, o.op) for o in s2.operands] == [("r", "ColVecLoad")]
    assert [(o.name, o.gated, o.dtype) for o in s2.outputs] == [("a", True, "bf16")]
    assert s3.d is not None and s3.d.name == "x2" and [o.op for o in s3.operands] == ["TileLoad"]
    assert (s2.gemm.a, s2.gemm.a_dtype, s2.gemm.ta, s2.gemm.tb) == ("hg", "bf16", False, False)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_emit_python_or_e07(path: Path) -> None:
    for block in coda_lang.load(path):
        for k in range(1, len(block.plan.stages) + 1):
            try:
                source = emit_stage(plan_stage(block, k))
            except CodaError as e:
                assert {d.code[:3] for d in e.diagnostics} == {"E07"}
                assert all(d.span is not None for d in e.diagnostics)
                continue
            tree = ast.parse(source)
            fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
            spec = plan_stage(block, k)
            prepass = [f"{spec.fn_name}_prepass"] if "prepass=" in source else []
            assert [f.name for f in fns] == prepass + [spec.fn_name]
            assert (
                spec.plain
                or spec.fn_name == f"epi_{spec.gemm.a}_{spec.gemm.b}".replace("__", "_")
                or spec.gemm.a.startswith("_")
            )
            assert all(f.args.args[0].arg == "acc" for f in fns)
            assert emit_stage(plan_stage(block, k)) == source  # deterministic


def test_every_op_has_an_emitter_or_a_clean_e0703() -> None:
    pending = {n for n, op in REGISTRY.items() if op.lower.cute is None}
    # the planner makes the indices TileIndex operands instead; fold runs between stages only
    assert pending == {"row_index", "col_index", "fold"}


@pytest.mark.parametrize("op, axis", [("row_index", 0), ("col_index", 1)])
def test_index_in_an_element_stage_is_a_tile_index_port(op: str, axis: int) -> None:
    """row_index()/col_index() compared with an i32 vector: the index is a TileIndex apply port called
    where it is used, the i32 vector a ColVecLoad/RowVecLoad (compared as f32), no equation for it."""
    other = "N" if axis == 0 else "M"  # an index vector against a vector over the other dim: a tile
    text = program(
        gemm(f"y = where({op}() == t, acc, 0.0)"), sig=f"x: bf16[M, K], w: bf16[K, N], t: i32[{other}]"
    )
    block = next(iter(coda_lang.load(text)))
    spec = plan_stage(block, 1)
    (ix,) = [o for o in spec.operands if o.op == "TileIndex"]
    assert ix.role == ("row index", "column index")[axis]
    assert all(e.op != op for e in spec.eqns)
    src = emit_stage(spec)
    assert f'TileIndex("{ix.py}", axis={axis})' in src
    assert f"{ix.py}(acc) == t" in src


UNDERSCORE_OPERAND = """dims M, K, N, F
block fwd(x: f16[M, K], w: f16[F, K], w9: f16[F, 2*N]) -> (y: bf16[M, 2*N], v7: f32[M]) {
  gemm x @ transpose(w) {
    v5 = silu(acc)
    v7 = max(v5 + v5, over=F)
  }
  gemm v5 @ w9 {
    y: bf16 = acc
  }
}
"""


def test_autodiff_temporaries_get_python_names_quack_takes() -> None:
    """Autodiff's temporaries (`_t11`) become epilogue operands and sinks; quack makes those fields of its
    argument dataclasses, which refuse a leading underscore (found by `coda fuzz --programs` on the H100:
    "Field names cannot start with an underscore"). Every pinned op of every backward stage is named
    without one."""
    blocks = [next(iter(coda_lang.load(UNDERSCORE_OPERAND))).grad()] + [
        b.grad() for b in (coda_lang.load(MLP)["llama_mlp"],)
    ]
    seen = 0
    for bwd in blocks:
        for k in range(1, len(bwd.plan.stages) + 1):
            try:
                spec = plan_stage(bwd, k)
            except coda_lang.CodaError:
                continue  # an elementwise stage (E0701)
            names = [o.py for o in spec.operands] + [s.py for s in spec.sinks] + [o.py for o in spec.outputs]
            seen += sum(o.name.startswith("_") for o in spec.operands)
            assert not [n for n in names if n.startswith("_")], names
            tree = ast.parse(emit_stage(spec))
            fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == spec.fn_name)
            assert not [a.arg for a in fn.args.args if a.arg.startswith("_")]
    assert seen  # the program does read an autodiff temporary in a GEMM stage


def test_backward_stages_all_emit_and_swiglu_backward_is_packed() -> None:
    """Every stage of llama_mlp's backward emits; the SwiGLU backward (width F, reading the saved
    pre-activation acc2 [M, 2F] and storing dacc2 [M, 2F]) is quack's packed_cd_b16x2 mode, as its
    hand-written `dgated_rstd_preact_mod`: C = acc2, D = dacc2, a row-scale ColVecLoad, and the norm's
    row statistic folding both lanes of each pair."""
    bwd = mlp().grad()
    specs = [plan_stage(bwd, k) for k in range(1, len(bwd.plan.stages) + 1)]
    sources = [emit_stage(s) for s in specs]
    packed = [s for s in specs if s.mode == "packed_cd_b16x2"]
    assert len(packed) == 1
    (s,) = packed
    assert s.c is not None and (s.c.name, s.c.py, s.c.dtype, s.c.lanes) == ("acc2", "c", "bf16", 2)
    assert s.d is not None and (s.d.name, s.d.dtype, str(s.d.shape[1])) == ("dacc2", "bf16", "2*F")
    assert [(o.name, o.op) for o in s.operands] == [("acc2", "C"), ("r", "ColVecLoad")]
    assert [(k.name, k.op, k.combine, k.lanes) for k in s.sinks] == [("dr", "ColVecReduce", "add", 2)]
    src = sources[specs.index(s)]
    assert 'mode="packed_cd_b16x2"' in src and "c_0, c_1 = unpack(c)" in src
    assert '"D": pack(' in src and '"dr": _t9_0 + _t9_1' in src  # (temporaries by their number in the stage)
    assert '"c"' not in src.split("def ")[0]  # c is quack's C operand, not a pinned epilogue op


def test_norm_backward_folds_a_scaled_column_reduction() -> None:
    bwd = mlp().grad()
    spec = next(
        plan_stage(bwd, k)
        for k in range(1, len(bwd.plan.stages) + 1)
        if any(s.op == "RowVecReduce" for s in _try_sinks(bwd, k))
    )
    (sink,) = spec.sinks
    assert (sink.name, sink.op, sink.scaled) == ("dg", "RowVecReduce", True)


def _try_sinks(block: coda_lang.Block, k: int) -> tuple:
    try:
        return plan_stage(block, k).sinks
    except CodaError:
        return ()


def test_write_source_is_content_addressed(tmp_path: Path) -> None:
    source = emit_stage(plan_stage(mlp(), 1))
    p1 = write_source(source, tmp_path)
    p2 = write_source(source, tmp_path)
    assert p1 == p2 and p1.read_text() == source
    assert p1.stem == module_name(source) and p1.parent == tmp_path / "epilogues"
    assert module_name(source + "#") != p1.stem
    assert EMITTER_VERSION


# ----------------------------------------------------------------------------------------------
# E07: what the backend can't compile yet, one program each


def program(
    body: str, sig: str = "x: bf16[M, K], w: bf16[K, N]", outs: str = "y: bf16[M, N]", dims: str = "M, K, N"
) -> str:
    return f"dims {dims}\nblock p({sig}) -> ({outs}) {{\n{body}\n}}\n"


def gemm(body: str) -> str:
    return "  gemm x @ w {\n" + "\n".join(f"    {line}" for line in body.splitlines()) + "\n  }"


E07_CASES = {
    "elementwise_stage": (
        "E0701",
        3,
        program("  elementwise [M, N] {\n    y = x * 2.0\n  }", sig="x: bf16[M, N]", dims="M, N"),
    ),
    "f32_gemm_operands": (
        "E0702",
        3,
        program(gemm("y = acc"), sig="x: f32[M, K], w: f32[K, N]", outs="y: f32[M, N]"),
    ),
    "integer_tile": (
        "E0702",
        4,
        program(gemm("y = acc + t"), sig="x: bf16[M, K], w: bf16[K, N], t: i32[M, N]"),
    ),
    "col_index_paired": (
        "E0703",
        5,
        program(
            gemm("g, u = pairs(acc)\nz: bf16 = where(col_index() == 0, acc, 0.0)\ny: bf16 = g * u"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, 2*F]",
            outs="y: bf16[M, F], z: bf16[M, 2*F]",
        ),
    ),
    "i32_vector_in_arithmetic": (
        "E0702",
        4,
        program(gemm("y = acc + cast(t, f32)"), sig="x: bf16[M, K], w: bf16[K, N], t: i32[M]"),
    ),
    "cast_to_i32": ("E0702", 4, program(gemm("y = cast(acc, i32)"), outs="y: i32[M, N]")),
    "half_width_tile_load": (
        "E0704",
        5,
        program(
            gemm("g, u = pairs(acc)\ny = g * u + t"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, 2*F], t: bf16[M, F]",
            outs="y: bf16[M, F]",
        ),
    ),
    "double_width_store_without_c": (
        "E0704",
        3,
        program(
            gemm("y = interleave(acc, acc)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, F]",
            outs="y: bf16[M, 2*F]",
        ),
    ),
    "double_width_f32_load": (
        "E0702",
        4,
        program(
            gemm("g, u = pairs(t)\ny = interleave(g * acc, u)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, F], t: f32[M, 2*F]",
            outs="y: bf16[M, 2*F]",
        ),
    ),
    "double_width_dtypes_differ": (
        "E0702",
        5,
        program(
            gemm("g, u = pairs(t)\ny: f16 = interleave(g * acc, u)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, F], t: bf16[M, 2*F]",
            outs="y: f16[M, 2*F]",
        ),
    ),
    "double_width_column_reduction": (
        "E0705",
        6,
        program(
            gemm("g, u = pairs(t)\ny = interleave(g * acc, u)\ns = sum(y, over=M)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, F], t: bf16[M, 2*F]",
            outs="y: bf16[M, 2*F], s: f32[2*F]",
        ),
    ),
    "logsumexp_over_rows": (
        "E0705",
        6,
        program(gemm("h = acc\ny = h\nl = logsumexp(h, over=M)"), outs="y: bf16[M, N], l: f32[N]"),
    ),
    "paired_logsumexp_over_rows": (
        "E0705",
        6,
        program(
            gemm("g, u = pairs(acc)\ny = g * u\nl = logsumexp(g, over=M)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, 2*F]",
            outs="y: bf16[M, F], l: f32[F]",
        ),
    ),
    "double_width_min_over_rows": (
        "E0705",
        6,
        program(
            gemm("g, u = pairs(t)\ny = interleave(g * acc, u)\ns = min(y, over=M)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, F], t: bf16[M, 2*F]",
            outs="y: bf16[M, 2*F], s: f32[2*F]",
        ),
    ),
    "grouped_of_grouped": (
        "E0705",
        5,
        program(
            gemm(
                "m = sum(acc, over=N, group=64)\n"
                "v = sum((acc - m) * (acc - m), over=N, group=64)\n"
                "y = (acc - m) * rsqrt(v)"
            )
        ),
    ),
    "grouped_by_4": ("E0705", 4, program(gemm("s = sum(acc * acc, over=N, group=4)\ny = acc * s"))),
    "grouped_by_48": ("E0705", 4, program(gemm("s = max(acc, over=N, group=48)\ny = acc - s"))),
    "grouped_tile_load": (
        "E0705",
        4,
        program(
            gemm("s = sum(acc * t, over=N, group=64)\ny = acc * s"),
            sig="x: bf16[M, K], w: bf16[K, N], t: bf16[M, N]",
        ),
    ),
    "grouped_half_width": (
        "E0705",
        5,
        program(
            gemm("g, u = pairs(acc)\ns = sum(g, over=F, group=64)\ny = g * s"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, 2*F]",
            outs="y: bf16[M, F]",
        ),
    ),
    "grouped_packed": (
        "E0705",
        5,
        program(
            gemm("g, u = pairs(t)\ns = sum(acc, over=F, group=64)\ny = interleave(g * acc * s, u)"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, F], t: bf16[M, 2*F]",
            outs="y: bf16[M, 2*F]",
        ),
    ),
    "grouped_derived_used_after": (
        "E0705",
        5,
        program(
            gemm("s = sum(acc * acc, over=N, group=64)\nr = rsqrt(s)\ny = acc * r"),
            outs="y: bf16[M, N], r: f32[M, N/64]",
        ),
    ),
    "grouped_reduced_over_groups": (
        "E0705",
        5,
        program(
            gemm("s = sum(acc, over=N, group=64)\nt = sum(s, over=N/64)\ny = acc * s"),
            outs="y: bf16[M, N], t: f32[M]",
        ),
    ),
    "paired_f32_store": (
        "E0702",
        5,
        program(
            gemm("g, u = pairs(acc)\ny = g * u"),
            dims="M, K, F",
            sig="x: bf16[M, K], w: bf16[K, 2*F]",
            outs="y: f32[M, F]",
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(E07_CASES))
def test_e07(name: str) -> None:
    code, line, text = E07_CASES[name]
    block = next(iter(coda_lang.load(text)))  # a valid program: `coda check` accepts it
    with pytest.raises(CodaError) as info:
        for k in range(1, len(block.plan.stages) + 1):
            emit_stage(plan_stage(block, k))
    (d,) = info.value.diagnostics
    assert (d.code, d.span.line if d.span else None) == (code, line), d.short()
    assert "Traceback" not in info.value.render("human")


def test_qk_norm_folds_its_grouped_sum_in_a_prepass() -> None:
    """qk_norm's per-head sum of squares is quack's prepass (as its qk_rope_epi): the prepass returns
    acc * acc for the GroupedReduce op `ss`, the main fn (acc_pair mode, RoPE) reads the raw per-head
    sum from lane 0 of `ss` and computes rsqrt(ss / 128 + eps) itself; the tile holds whole heads."""
    spec = plan_stage(coda_lang.load(ROOT / "examples" / "qk_norm.coda")["qk_norm"], 1)
    assert spec.mode == "acc_pair" and spec.sinks == ()
    assert [(g.name, g.py, g.combine, g.width, g.out) for g in spec.groups] == [
        ("ss", "ss", "add", 128, None)
    ]
    assert [e.op for e in spec.prepass] == ["mul"] and spec.groups[0].value == spec.prepass[0].outs[0].name
    assert "tile_N % 128 == 0 (group=128 over `2*P`)" in map(str, spec.tiling)
    assert all(e.op != "reduce_sum" for e in spec.eqns)
    src = emit_stage(spec)
    assert 'prepass=epi_x_w_q_prepass, prepass_outs=("ss",)' in src
    assert '"ss": GroupedReduce("ss")' in src and "def epi_x_w_q(acc, eps, g, pos, freq, dim_HD, ss):" in src
    assert "ss_0, ss_1 = unpack(ss)" in src and "cute.math.rsqrt(" in src


GROUPED = program(
    gemm(
        "s = sum(acc * acc, over=N, group=64)\nm = max(abs(acc + b), over=N, group=64)\n"
        "y = acc * rsqrt(s / 64.0) / m"
    ),
    sig="x: bf16[M, K], w: bf16[K, N], b: f32[N]",
    outs="y: bf16[M, N], s: f32[M, N/64]",
)


def test_grouped_max_and_a_stored_group() -> None:
    """Element mode: two grouped reductions (a sum and a max of |acc + b|, the prepass reading the
    operand b), the sum used after the stage, written by its GroupedColStatsOut."""
    spec = plan_stage(next(iter(coda_lang.load(GROUPED))), 1)
    assert spec.mode == "element"
    assert [(g.name, g.combine, g.width, g.out) for g in spec.groups] == [
        ("s", "add", 64, "s_out"),
        ("m", "max", 64, None),
    ]
    assert [e.op for e in spec.prepass] == ["mul", "add", "abs"]
    src = emit_stage(spec)
    assert "def epi_x_w_prepass(acc, b):" in src and 'return {"s": _t1, "m": _t3}' in src
    assert '"m": GroupedReduce("m", combine="max")' in src
    assert 'extra_ops=(GroupedReduce("s").out("s_out"),)' in src
    assert 'prepass_outs=("s", "m")' in src


MINS = program(
    gemm("h = acc + b\ny = h\nr = min(h, over=N)\nc = min(acc * b, over=M)"),
    sig="x: bf16[M, K], w: bf16[K, N], b: f32[N]",
    outs="y: bf16[M, N], r: f32[M], c: f32[N]",
)


def test_min_reductions_fold_the_negation_by_max() -> None:
    """min(x) = -max(-x): a min over the columns (rows) is a ColVecReduce (RowVecReduce) with combine="max"
    of the negated value; the sink says so (`negate`), and the runtime negates the buffer back."""
    spec = plan_stage(next(iter(coda_lang.load(MINS))), 1)
    assert [(s.name, s.op, s.combine, s.negate, s.layout) for s in spec.sinks] == [
        ("r", "ColVecReduce", "max", True, "row partials"),
        ("c", "RowVecReduce", "max", True, "column partials"),
    ]
    src = emit_stage(spec)
    assert 'reduces={"r": ColVecReduce("r", combine="max"), "v_c": RowVecReduce("v_c", combine="max")}' in src
    assert 'return {"D": y, "r": -h, "v_c": -_t1}' in src
    assert (
        "min over the columns, one partial per column tile (ColVecReduce, max of the negation: the buffer "
        "holds -min)" in src
    )


def test_min_reductions_in_paired_and_packed_modes() -> None:
    """acc_pair mode: a half-width min pads its second lane with itself (negated, like the first); a
    full-width one negates both lanes. Packed mode: a min over a double-width tile folds its two lanes
    first, as the max of their negations."""
    paired = program(
        gemm("g, u = pairs(acc)\ny = g * u\nr = min(g, over=F)\nc = min(acc, over=M)"),
        dims="M, K, F",
        sig="x: bf16[M, K], w: bf16[K, 2*F]",
        outs="y: bf16[M, F], r: f32[M], c: f32[2*F]",
    )
    src = emit_stage(plan_stage(next(iter(coda_lang.load(paired))), 1))
    assert '"r": pack(-g, -g), "v_c": pack(-acc_0, -acc_1)' in src and 'mode="acc_pair"' in src
    packed = program(
        gemm("g, u = pairs(t)\ny = interleave(g * acc, u)\nr = min(y, over=2*F)"),
        dims="M, K, F",
        sig="x: bf16[M, K], w: bf16[K, F], t: bf16[M, 2*F]",
        outs="y: bf16[M, 2*F], r: f32[M]",
    )
    spec = plan_stage(next(iter(coda_lang.load(packed))), 1)
    assert [(s.lanes, s.negate) for s in spec.sinks] == [(2, True)]
    assert '"r": cute.math.max(-y_0, -y_1, propagate_nan=True)' in emit_stage(spec)


DIMS_AS_VALUES = program(gemm("h = acc / K + acc * N\ny = h - M"))


def test_a_dim_used_as_a_value_is_a_scalar_operand() -> None:
    """`acc / K` inside a stage: each dim used is a Scalar operand holding its size (passed by the
    runtime from the call's sizes), read by name in the emitted fn."""
    spec = plan_stage(next(iter(coda_lang.load(DIMS_AS_VALUES))), 1)
    assert [(o.name, o.py, o.op, o.dtype) for o in spec.operands] == [
        ("%K", "dim_K", "Scalar", "f32"),
        ("%N", "dim_N", "Scalar", "f32"),
        ("%M", "dim_M", "Scalar", "f32"),
    ]
    src = emit_stage(spec)
    assert (
        '@gemm_epilogue(ops={"dim_K": Scalar("dim_K"), "dim_N": Scalar("dim_N"), "dim_M": Scalar("dim_M")})'
        in src
    )
    assert "acc / dim_K" in src and "acc * dim_N" in src and "- dim_M" in src
    assert "load   dim_K = the size of K: f32 scalar (Scalar)" in src


def test_sums_whose_padding_is_not_zero_are_masked() -> None:
    """A sum over the columns (or max(abs())) whose value past the end of the reduced dim is not 0
    whatever the inputs emits epi_ops' Bounded*Reduce (quack's own would fold those elements): every
    such sum of a value of acc, since the accumulator there is NaN in a row of A holding an infinity
    (a sum over the rows, as before: where it is not 0 there for finite inputs). One that is 0 there for
    finite inputs is masked in the ragged last tile only (`ragged_only`, a branch) and, a sum of a
    product, stays one fma (both factors masked); one that is not is masked in every tile and folded
    plain, as before. A sum of loaded tiles alone (zeros there, TMA's fill) stays
    quack's. A max of abs() is a plain max of |x| (quack masks a max's padding itself; its max.abs
    fold dropped NaN). llama_mlp's RMSNorm statistic is masked and stays one fma."""
    from runtime_check import RAGGED_SUMS

    spec = plan_stage(next(iter(coda_lang.load(RAGGED_SUMS))), 1)
    assert {s.name: (s.bounded, s.scaled) for s in spec.sinks} == {
        "s": (True, False),
        "u": (True, False),
        "q": (True, True),
        "z": (True, False),
        "v": (True, False),
        "a": (False, False),
    }
    src = emit_stage(spec)
    assert '"s": BoundedColVecReduce("s")' in src and '"u": BoundedRowVecReduce("u")' in src
    assert '"q": BoundedColVecReduce("q", scaled=True, ragged_only=True)' in src
    assert '"z": BoundedColVecReduce("z", ragged_only=True)' in src
    assert [s.name for s in spec.sinks if s.ragged_only] == ["q", "z"]  # 0 there for finite inputs
    assert '"a": ColVecReduce("a", combine="max")' in src and "max_abs" not in src
    assert "from coda_lang.backend_cute.plan.epi_ops import BoundedColVecReduce, BoundedRowVecReduce" in src
    tiles_only = """dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], t: bf16[M, N]) -> (o: bf16[M, N], z: f32[M], y: f32[M]) {
  gemm x @ w {
    o = acc
    z = sum(t * 2.0, over=N)
    y = sum(t * t, over=N)
  }
}
"""
    spec = plan_stage(coda_lang.load(tiles_only)["b"], 1)
    assert {s.name: (s.bounded, s.scaled) for s in spec.sinks} == {"z": (False, False), "y": (False, True)}
    assert [(s.name, s.bounded, s.scaled, s.ragged_only) for s in plan_stage(mlp(), 1).sinks] == [
        ("ss", True, True, True)
    ]
    from runtime_check import DIMS_AS_VALUES as SUM_OF_DIMS  # s = sum(h * K), h = acc / K + b * N - M

    assert [s.bounded for s in plan_stage(next(iter(coda_lang.load(SUM_OF_DIMS))), 1).sinks] == [True]


def test_pick_is_bounded_by_n() -> None:
    """pick() emits epi_ops.BoundedColVecSelect: quack's ColVecSelect, which would also select the ragged
    last tile's columns past N (an index in [N, the tile's end) is out of range: the row stays 0)."""
    spec = plan_stage(coda_lang.load(ROOT / "examples" / "lm_head_ce.coda")["lm_head_ce"], 1)
    assert [s.op for s in spec.sinks if s.index is not None] == ["ColVecSelect"]
    src = emit_stage(spec)
    assert "from coda_lang.backend_cute.plan.epi_ops import BoundedColVecSelect" in src
    assert "BoundedColVecSelect(" in src and "import ColVecSelect" not in src


def test_grouped_min_and_logsumexp() -> None:
    """Grouped min and logsumexp are GroupedReduce ops folding by min (from +inf) and by the log-sum-exp
    of two values (from -inf) in the prepass, like a grouped sum or max."""
    text = program(
        gemm("s = logsumexp(acc + b, over=N, group=64)\nm = min(acc, over=N, group=32)\ny = acc - s + m"),
        sig="x: bf16[M, K], w: bf16[K, N], b: f32[N]",
        outs="y: bf16[M, N], s: f32[M, N/64]",
    )
    spec = plan_stage(next(iter(coda_lang.load(text))), 1)
    assert [(g.name, g.combine, g.width, g.out) for g in spec.groups] == [
        ("s", "lse", 64, "s_out"),
        ("m", "min", 32, None),
    ]
    src = emit_stage(spec)
    assert '"s": GroupedReduce("s", combine="lse"), "m": GroupedReduce("m", combine="min")' in src
    assert 'extra_ops=(GroupedReduce("s", combine="lse").out("s_out"),)' in src
    assert "group  s: f32[M, N/64] = logsumexp over each run of 64 columns" in src
    assert "group  m: f32[M, N/32] = min over each run of 32 columns" in src


def test_a_stage_storing_acc_and_a_group_is_not_plain() -> None:
    """D = acc plus a grouped sum used after the stage: quack's kernel, never a bare cuBLAS GEMM."""
    from coda_lang.backend_cute.build.config import is_plain

    text = program(
        gemm("s = sum(acc * acc, over=N, group=64)\ny = acc"), outs="y: bf16[M, N], s: f32[M, N/64]"
    )
    spec = plan_stage(next(iter(coda_lang.load(text))), 1)
    assert [g.out for g in spec.groups] == ["s_out"] and not is_plain(spec)


def test_bare_gemm_stages_share_one_kernel_per_dtype_and_majors(tmp_path: Path) -> None:
    """Every plain stage (D = acc) of the Llama model's blocks, forward and backward, emits one of two
    modules (`transpose(a) @ b` and `a @ b`) with none of the stage's names in it, so their kernels
    (and their tuning) are shared: 12 plain stages, 2 kernels per tile. A stage that does anything
    else keeps its own module."""
    import coda_lang.hf.blocks as hb
    from coda_lang.backend_cute.build.cache import ptx_key
    from coda_lang.backend_cute.build.config import TileConfig

    prog = coda_lang.load(hb.model_source("bfloat16", 1e-5, 64, False))
    plain, other = {}, {}
    weights = {"w_o", "w_13", "w_2", "w_qkv", "w_lm", "g", "g1", "g2", "h", "y", "x", "hg", "r"}
    for name in ("first_qkv", "layer", "last", "head_loss"):
        blk = prog[name]
        bwd = blk.derivation([p.var.name for p in blk.ir.params if p.var.name in weights], "auto")
        for b in (blk, bwd.backward):
            for k, st in enumerate(b.ir.stages, 1):
                if not st.is_gemm:
                    continue
                spec = plan_stage(b, k)
                (plain if spec.plain else other)[(b.name, k)] = spec
    assert len(plain) == 12 and len(other) == 16
    names = {s.fn_name for s in plain.values()}
    assert names == {"plain_bf16_tn", "plain_bf16_nn"}
    for fn in names:
        group = [s for s in plain.values() if s.fn_name == fn]
        sources = {emit_stage(s) for s in group}
        assert len(sources) == 1, fn
        src = sources.pop()
        assert not any(s.block in src or s.d.name in src for s in group if s.d)  # nothing of a stage
        ast.parse(src)
        majors = {(s.gemm.ta, s.gemm.tb) for s in group}
        assert majors == {(fn.endswith("tn"), False)}
        c = TileConfig(128, 128)
        assert len({ptx_key(emit_stage(s), c) for s in group}) == 1
    # the others: one module per meaning. The last layer's out-proj and gate/up stages are the layers'
    # (the same MLP text), and so are their backwards' SwiGLU and norm-backward stages (the same text
    # but for autodiff's numbering of temporaries); the rest are their own
    shared = {
        ("layer", 1): ("last", 1),
        ("layer", 2): ("last", 2),
        ("layer_bwd", 4): ("last_bwd", 2),
        ("layer_bwd", 6): ("last_bwd", 4),
    }
    sources = {key: emit_stage(s) for key, s in other.items()}
    for a, b in shared.items():
        assert sources[a] == sources[b], (a, b)
        assert ptx_key(sources[a], TileConfig(128, 128)) == ptx_key(sources[b], TileConfig(128, 128))
    assert len(set(sources.values())) == len(other) - len(shared) == 12
    for key, src in sources.items():  # nothing of where the stage stands
        assert f"block `{key[0]}`" not in src and f"{key[0]}_stage" not in src and "_t77" not in src


def test_the_olmo2_blocks_plan_and_emit() -> None:
    """OLMo 2's program (coda_lang.hf: post norms, no pre-norms, q and k each normalized over its
    projection's whole width) fuses as `coda check` says: each full-row norm is a GEMM storing its tile
    and folding the partial sums of squares (a column reduction per tile), then a row stage. Every GEMM
    stage of its blocks and of the backwards the patch runs plans and emits Python without a GPU, and
    every row stage is one the Triton generator takes (tests/test_triton_stage.py runs them)."""
    import coda_lang.hf.blocks as hb
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import unsupported

    src = hb.model_source("bfloat16", 1e-6, 64, "proj", pre_norm=False, post_norm=True, heads=(16, 8))
    prog = coda_lang.load(src)
    shape = {n: [s.is_gemm for s in prog[n].ir.stages] for n in ("first_qkv", "layer", "last")}
    assert shape == {
        "first_qkv": [True, False],  # QKV, the q/k norm's row stage (row scales, weight, RoPE)
        "layer": [True, False, True, True, False, True, False],  # o, x1, gate/up, down, x2, QKV, q/k
        "last": [True, False, True, True, False],  # ... x2 and the final norm's statistics
    }
    o, _, _, m, _, qkv, _ = (
        plan_stage(prog["layer"], k) if g else None for k, g in enumerate(shape["layer"], 1)
    )
    for spec, tile, ss in ((o, "o", "sso"), (m, "m", "ssm"), (qkv, "zr", None)):
        assert spec is not None and spec.mode == "element" and spec.d is not None and spec.d.name == tile
        if ss:
            assert [(k.name, k.op, k.value) for k in spec.sinks] == [(ss, "ColVecReduce", (tile, tile))]
    assert qkv is not None and [(k.name, k.op) for k in qkv.sinks] == [
        ("ssq", "ColVecReduce"),
        ("ssk", "ColVecReduce"),
    ]
    weights = {"w_o", "w_13", "w_2", "w_qkv", "go", "gd", "g2", "gqk", "h", "y", "x"}
    for name in ("first_qkv", "layer", "last"):
        blk = prog[name]
        bwd = blk.derivation([p.var.name for p in blk.ir.params if p.var.name in weights], "auto").backward
        for b in (blk, bwd):
            for k, st in enumerate(b.ir.stages, 1):
                if st.is_gemm:
                    ast.parse(emit_stage(plan_stage(b, k)))
                else:
                    assert unsupported(ElementwiseStage(b, k, emulate=True)) is None, (b.name, k)


def test_half_width_column_vector_is_loaded_repeated() -> None:
    """RoPE's freq[P] in a stage of width 2*P: loaded at full width (the runtime passes
    freq.repeat_interleave(2)), read from lane 0."""
    spec = plan_stage(coda_lang.load(ROOT / "examples" / "qkv_rope.coda")["qkv_rope"], 1)
    freq = next(o for o in spec.operands if o.name == "freq")
    assert (freq.op, freq.host, freq.lanes) == ("RowVecLoad", "repeat_interleave(2)", 2)
    assert "freq_0, freq_1 = unpack(freq)" in emit_stage(spec)


def test_second_full_width_store_of_a_paired_stage_is_split_into_lanes() -> None:
    """quack's acc_pair mode stores only D at full width: another full-width tile (llama_block's saved
    pre-RoPE accumulator) becomes two gated TileStores, one per lane, interleaved back by the runtime."""
    text = program(
        gemm("z = acc * 2.0\nq = acc * 3.0\ng, u = pairs(acc)\ny = g * u"),
        dims="M, K, F",
        sig="x: bf16[M, K], w: bf16[K, 2*F]",
        outs="y: bf16[M, F], z: bf16[M, 2*F], q: bf16[M, 2*F]",
    )
    spec = plan_stage(next(iter(coda_lang.load(text))), 1)
    assert spec.mode == "acc_pair" and spec.d is not None and spec.d.name == "q"
    assert [(o.name, o.py, o.gated, o.lane) for o in spec.outputs] == [
        ("z", "z_lane0", True, 0),
        ("z", "z_lane1", True, 1),
        ("y", "y", True, None),
    ]
    source = emit_stage(spec)
    assert '"z_lane0": z_0, "z_lane1": z_1' in source


def test_reserved_names_are_renamed() -> None:
    text = program(gemm("c = acc * 2.0\nD = c + 1.0\ny = D"))
    source = emit_stage(plan_stage(next(iter(coda_lang.load(text))), 1))
    compile(source, "<emitted>", "exec")
    assert 'return {"D": y}' in source


# ----------------------------------------------------------------------------------------------
# Imports and the CLI


def test_import_coda_lang_imports_no_gpu_library() -> None:
    code = (
        "import sys, coda_lang, coda_lang.cli, coda_lang.backend_cute.plan.planner, coda_lang.backend_cute.plan.emit, "
        "coda_lang.backend_cute.build.compile; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_cli_compile_source(tmp_path: Path) -> None:
    r = coda("compile", MLP, "--emit", "source", "-o", tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"llama_mlp_stage{k}.py" for k in (1, 2, 3)]
    assert (tmp_path / "llama_mlp_stage2.py").read_text() == emit_stage(plan_stage(mlp(), 2))
    assert r.stdout.splitlines()[0].startswith(
        f"wrote {tmp_path / 'llama_mlp_stage1.py'}: stage 1 `gemm y @ w_o`"
    )


def test_cli_compile_e07_exits_1(tmp_path: Path) -> None:
    src = tmp_path / "two.coda"
    src.write_text(
        program(
            gemm("y = acc") + "\n  gemm y @ w2 {\n    z = acc\n    l = logsumexp(acc, over=M)\n  }",
            sig="x: bf16[M, K], w: bf16[K, N], w2: bf16[N, N]",
            outs="z: bf16[M, N], l: f32[N]",
        )
    )
    r = coda("compile", src, "--emit", "source", "-o", tmp_path, "--error-format", "short")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert f"{src}:8:5: error[E0705]: logsumexp() over the rows is not compiled yet" in r.stderr
    assert [p.name for p in tmp_path.glob("p_stage*.py")] == [
        "p_stage1.py"
    ]  # the other stage is still written


def test_cli_compile_backward_source(tmp_path: Path) -> None:
    r = coda("compile", MLP, "--emit", "source", "--backward", "-o", tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.py")) == [
        f"llama_mlp_bwd_stage{k}.py" for k in range(1, 7)
    ]
    assert "packed_cd_b16x2 mode; D = dacc2; stores a; reduces dr" in r.stdout  # a recomputed (auto)


def test_cli_compile_one_stage(tmp_path: Path) -> None:
    """--stage K writes that stage only (llama_mlp's backward has six)."""
    r = coda("compile", MLP, "--emit", "source", "--backward", "--stage", "4", "-o", tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.glob("*.py")] == ["llama_mlp_bwd_stage4.py"]
    assert len(r.stdout.splitlines()) == 1 and "stage 4 `" in r.stdout


def test_cli_compile_skips_an_elementwise_stage(tmp_path: Path) -> None:
    r = coda(
        "compile", ROOT / "examples" / "bias_gelu.coda", "--emit", "source", "--backward", "-o", tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "stage 1 `elementwise [M, N]`: no GEMM, nothing to emit" in r.stdout
    assert (
        not (tmp_path / "bias_gelu_bwd_stage1.py").exists()
        and (tmp_path / "bias_gelu_bwd_stage2.py").exists()
    )


@pytest.mark.parametrize(
    "args",
    [
        ("compile", "nope.coda", "--emit", "source"),
        ("compile", MLP, "--emit", "source", "--tile", "128x128"),
        ("compile", MLP, "--emit", "ptx", "--tile", "big"),
        ("compile", MLP, "--emit", "ptx", "--tile", "128x192e"),
        ("compile", MLP, "--emit", "ptx", "--tile", "128x0"),
        ("compile", MLP),
        ("compile", MLP, "--emit", "source", "--block", "nope"),
        ("compile", MLP, "--emit", "source", "--stage", "0"),
        ("compile", MLP, "--emit", "source", "--stage", "4"),
        ("compile", MLP, "--emit", "source", "--stage", "two"),
    ],
)
def test_cli_compile_usage_errors_exit_2(
    args: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the command's `main` in this process (the other tests here run the real command line)."""
    from coda_lang.cli import main

    try:
        code = main([str(a) for a in (*args, "-o", tmp_path)])
    except SystemExit as e:  # argparse's own errors
        code = e.code if isinstance(e.code, int) else 2
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.strip()


def test_parse_ptxas_report() -> None:
    from coda_lang.backend_cute.build.ptxas import parse_ptxas

    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kernel_x' for 'sm_90a'
ptxas info    : Function properties for kernel_x
    152 bytes stack frame, 574 bytes spill stores, 624 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 152 bytes cumulative stack size
"""
    r = parse_ptxas(text, "ptxas 13.0")
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.spills) == (168, 574, 624, 152, True)
    assert str(r) == "168 registers, 574 bytes spill stores, 624 bytes spill loads (ptxas 13.0)"


def test_epilogue_sin_cos_reduce_the_argument_to_within_rounding() -> None:
    """epi_ops.sin_rr / cos_rr reduce the argument by 2 pi in three f32 parts (each product with the
    multiple exact inside an fma) before the hardware's approximation: emulated here in NumPy (fma as an
    exact product and one rounding), the reduced argument's sine is within 2e-7 of float64's sine of
    the f32 argument, for RoPE's angles up to 128k positions; and the emitted stages call them."""
    pytest.importorskip("cutlass")
    import warnings

    import numpy as np

    with warnings.catch_warnings():  # quack's own DeprecationWarnings about CuTeDSL names
        warnings.simplefilter("ignore", DeprecationWarning)
        from coda_lang.backend_cute.plan import epi_ops

    f = np.float32
    parts = [f(epi_ops._TWO_PI_1), f(epi_ops._TWO_PI_2), f(epi_ops._TWO_PI_3)]
    assert abs(sum(float(p) for p in parts) - 2 * np.pi) < 1e-15
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-20, 20, 4000), rng.uniform(0, 131072, 4000), [0.0, np.pi, 1e5]]).astype(
        f
    )
    k = np.round(x * f(epi_ops._INV_TWO_PI)).astype(np.float64)  # roundeven of the f32 product
    r = x.astype(np.float64)
    for p in parts:
        r = (-k * np.float64(p) + r).astype(f).astype(np.float64)  # fma: exact product, one rounding
    assert np.abs(r).max() < np.pi + 0.02  # within sin.approx's accurate range
    err = np.abs(np.sin(r) - np.sin(x.astype(np.float64)))
    assert err.max() < 2e-7, err.max()
    for name, fn in (("sin", "sin_rr"), ("cos", "cos_rr")):
        cute = REGISTRY[name].lower.cute
        assert cute is not None and cute("a") == f"{fn}(a)"
