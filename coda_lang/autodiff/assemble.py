"""The end of a derivation: the gradients, the backward block, and the forward extended to save.

What it does: `finalize` makes each gradient from the cotangent contributions its parameter got
(renaming the one equation that made it where there is one, else summing them, in an elementwise
stage for a matrix); `assemble` cleans the backward body (cse, dce, renames), orders its parameters
(cotangents, then saved tensors), keeps the report lines of stages that survived, and returns
`Derived`: the backward block, and the forward block extended to store the SAVED reads of
`State.reads` that it does not store anyway (each saved `acc` as a copy at the end of its stage).
What it does not: differentiate anything (reverse.py and site.py did) or check the blocks.
Invariants: a block declares only the dims it names; `Derived.saved` lists the saved tensors the
backward still reads after clean-up, in the order the backward first read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from coda_lang.autodiff.cleanup import cse, dce, rename, used_names
from coda_lang.autodiff.state import SAVED, Read, State
from coda_lang.ir.nodes import DEFAULT_REMAT, Atom, Block, DimRef, Eqn, Lit, Output, Param, Stage, Stmt, Var
from coda_lang.ir.types import MATRIX, SCALAR, TILE, VEC, Dim, Type, cotangent_dtype
from coda_lang.ops import StageShape


@dataclass
class Derived:
    """What `derive` returns (api.Derivation is the checked form of it)."""

    forward: Block  # the forward block, extended to store what the backward reads
    backward: Block
    saved: tuple[str, ...]  # forward values the backward reads (params of the backward block)
    cotangents: dict[str, str]  # forward output -> its cotangent's name in the backward block
    grads: dict[str, str]  # forward param -> its gradient's name (an output of the backward block)
    report: list[str] = field(default_factory=list)
    # every read of a forward value the derivation made, and how (State.reads); made before clean-up,
    # so some may be unused in `backward` (`saved` lists the saved tensors it does read)
    reads: tuple[Read, ...] = ()
    # fp8 cotangents (BackwardOptions.fp8_grads): each scale (a scalar input of the backward) -> the
    # output holding this step's amax of the cotangent it scales (for the next step's scale)
    scales: dict[str, str] = field(default_factory=dict)
    # outputs no gradient flows back from (made through detach, or from no `wrt` parameter): their
    # cotangents reach nothing (a torch wrapper marks them non-differentiable)
    detached: frozenset[str] = frozenset()


def _kind(t: Type) -> str:
    return (SCALAR, VEC, MATRIX)[len(t.shape)]


def finalize(s: State) -> tuple[dict[str, str], dict[str, str]]:
    """(forward param -> its gradient's name; renames of the values that are gradients)."""
    grads: dict[str, str] = {}
    renames: dict[str, str] = {}
    b = s.b
    for name in s.fwd.wrt:
        p = s.fwd.params[name]
        t = p.var.type
        assert t is not None
        parts = s.take_cotangents(name)
        single = parts[0] if len(parts) == 1 and isinstance(parts[0], Var) else None
        if single is not None and single.name.startswith(f"d{name}") and single.name not in s.bparams:
            out_name = single.name  # already named for it
        else:
            out_name = s.names.fresh(f"d{name}")
        grads[name] = out_name
        kind = _kind(t)
        if kind == MATRIX:
            _finalize_matrix(s, name, parts, out_name, t, renames)
        elif single is not None and single.name not in s.bparams and s.types.get(single.name, t).kind == kind:
            if single.name not in renames:
                renames[single.name] = out_name
            else:
                # the value another parameter's gradient is already named for (`v = r + p`: both get
                # v's cotangent): this one is a copy of it (renamed with it), not a second name for it
                with s.between_stages():
                    b.span = p.span
                    b.op("copy", single, name=out_name)
        else:
            with s.between_stages():
                b.span = p.span
                total: Atom = Lit(0.0, "f32")
                for part in parts:
                    total = b.add(total, part)
                if kind == VEC and b.type_of(total).kind != VEC:
                    total = b.op("expand", total, s.read_param(name))
                b.op("copy", total, name=out_name)
    return grads, renames


def _finalize_matrix(
    s: State, name: str, parts: list[Atom], out_name: str, t: Type, renames: dict[str, str]
) -> None:
    b = s.b
    single = parts[0] if len(parts) == 1 and isinstance(parts[0], Var) else None
    # The usual case: one contribution, made by an equation of this backward: rename it. A backward
    # parameter, or a value already named for another parameter's gradient (`y = a + b`: both get y's
    # cotangent), is aliased instead
    if single is not None and (single.name in s.bparams or single.name in renames):
        with s.between_stages():
            b.op("copy", single, name=out_name)  # an alias (e.g. a residual's gradient)
        return
    if single is not None:
        renames[single.name] = out_name  # (to itself: keeps its annotation-free output form)
        return
    span = s.fwd.params[name].span
    shape = StageShape(t.shape[0], t.shape[1])
    s.open_stage(shape, acc=False)
    b.span = span
    total: Atom = Lit(0.0, "f32")
    for part in parts:
        total = b.add(total, part)
    tile = b.stage_tile(total) if b.type_of(total).kind != TILE else total
    if tile is None:  # a square stage: the parameter itself gives the shape
        tile = b.op("expand", total, s.read_param(name))
    b.op("copy", tile, name=out_name)
    before, body = s.close_stage()
    s.emit(before)
    s.emit([Stage(None, None, False, False, None, tuple(body), (shape.rows, shape.cols), span=span)])
    why = "is summed" if parts else "is zero (no output depends on it): written"
    s.note(span, f"the gradient of `{name}` {why} in an elementwise stage")


_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1, "i32": 4, "bool": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of a storage dtype."""
    return _ITEMSIZE.get(dtype, 4)


def token_rows(block: Block) -> str | None:
    """The dim of a block's token rows, what "per row" counts: the rows of its first GEMM stage (an
    fp8 block's first stages may be elementwise ones over its weights), else of its first stage."""
    for s in block.stages:
        if s.is_gemm and s.acc is not None and s.acc.type is not None:
            return s.acc.type.shape[0].name
    for s in block.stages:
        if s.shape is not None:
            return s.shape[0].name
    return None


def _per_row(t: Type, rows: str | None) -> bool:
    """Whether a tensor of type t holds bytes per row of `rows` (None: of its first dim, whatever it
    is); a scalar holds nothing per row and is counted as per row (0)."""
    return rows is None or not t.shape or t.shape[0].name == rows


def row_bytes(types: list[Type], rows: str | None = None) -> dict[str | None, Fraction]:
    """What tensors of these types hold per row of their first dim: dim name (None: a constant) ->
    bytes per unit of that dim; `bf16[M, 2*F]` and `f32[M]` hold {"F": 4, None: 4}. With `rows`, only
    the tensors whose first dim is `rows` (a `[2*M, D]` one twice per row); the others are
    `fixed_bytes`'."""
    per: dict[str | None, Fraction] = {}
    for t in types:
        if not t.shape or not _per_row(t, rows):
            continue
        size = Fraction(itemsize(t.dtype)) * (t.shape[0].coeff if rows is not None else 1)
        if len(t.shape) == 1:
            per[None] = per.get(None, Fraction(0)) + size
            continue
        d = t.shape[1]
        key = d.name
        per[key] = per.get(key, Fraction(0)) + size * d.coeff
    return per


def fixed_bytes(types: list[Type], rows: str | None) -> dict[tuple[str, ...], Fraction]:
    """What the tensors of these types whose first dim is not `rows` hold (a weight's fp8 copy
    `e4m3[2*F, D]`: bytes that do not scale with the rows): monomial (the dim names, sorted) -> its
    coefficient; `e4m3[2*F, D]` holds {("D", "F"): 2}. Scalars are left out (a few bytes)."""
    out: dict[tuple[str, ...], Fraction] = {}
    for t in types:
        if not t.shape or _per_row(t, rows):
            continue
        c = Fraction(itemsize(t.dtype))
        names: list[str] = []
        for d in t.shape:
            c *= d.coeff
            if d.name is not None:
                names.append(d.name)
        key = tuple(sorted(names))
        out[key] = out.get(key, Fraction(0)) + c
    return out


def fixed_text(per: dict[tuple[str, ...], Fraction]) -> str:
    """`fixed_bytes` written as a sum (`3*D*F + 64 bytes`)."""
    terms = []
    for key, c in sorted(per.items(), key=lambda kv: (not kv[0], kv[0])):
        if not c:
            continue
        if not key:
            terms.append(str(c))
            continue
        mono = "*".join(key)
        terms.append(mono if c == 1 else f"{c}*{mono}" if c.denominator == 1 else f"({c})*{mono}")
    return (" + ".join(terms) or "0") + " bytes"


def bytes_per_row(types: list[Type], rows: str | None = None) -> str:
    """What tensors of these types hold per row of their first dim (with `rows`: of the tensors whose
    first dim is `rows`), as a sum over the other dims: `bf16[M, 2*F]` and `f32[M]` hold
    `4*F + 4 bytes`; a scalar holds nothing per row."""
    per = row_bytes(types, rows)
    terms = [
        str(Dim(c, name))
        for name, c in sorted(per.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
        if name is not None and c
    ]
    if per.get(None):
        terms.append(str(per[None]))
    return (" + ".join(terms) or "0") + " bytes"


def assemble(s: State, grads: dict[str, str], renames: dict[str, str], remat: str = DEFAULT_REMAT) -> Derived:
    f = s.fwd.block
    amaxes = set(s.scales.values())
    keep = set(grads.values()) | set(renames) | set(s.ct) | amaxes
    body = dce(cse(s.body, keep), set(grads.values()) | set(renames) | amaxes)
    body = rename(body, renames)
    body = rename(body, {k: v for k, v in s.cosmetic.items() if k not in renames})
    alive = {(st.span, st.is_gemm) for st in body if isinstance(st, Stage)}
    report = [text for span, text, gemm in s.report if (span, gemm) in alive]
    used = used_names(body)
    params = [p for n, p in s.bparams.items() if n in used or n in s.cotangents.values()]
    saved_all = s.saved()
    order = {n: i for i, n in enumerate(list(s.cotangents.values()) + saved_all)}
    params.sort(key=lambda p: order.get(p.var.name, len(order)))
    saved = tuple(n for n in saved_all if n in used)
    outputs = []
    for name, g in grads.items():
        t = s.fwd.params[name].var.type
        assert t is not None
        outputs.append(Output(g, Type(cotangent_dtype(t.dtype), t.shape, _kind(t)), s.fwd.params[name].span))
    scales = {k: v for k, v in s.scales.items() if k in used}
    for amax in scales.values():
        outputs.append(Output(amax, Type("f32", (), SCALAR), f.span))
    dims = tuple(d for d in f.dims if d.name in _used_dims(params, outputs, body))
    rows = token_rows(f)
    per_row = [n for n in saved if _per_row(s.types[n], rows)]
    fixed = [n for n in saved if n not in per_row]
    notes = [
        f"backward of `{f.name}`, derived by `coda grad`",
        "saved tensors (stored by the forward): " + (", ".join(saved) or "none"),
        f"saved per row: {bytes_per_row([s.types[n] for n in per_row], rows)} ({policy_text(s, remat)})",
        "cotangents: " + ", ".join(f"{v} (of {k})" for k, v in s.cotangents.items()),
        "gradients: " + ", ".join(f"{v} (of {k})" for k, v in grads.items()),
    ]
    if fixed:  # (a weight's fp8 copy: bytes that do not scale with the rows)
        notes.insert(
            2,
            f"saved, not per row of {rows}: "
            + ", ".join(
                f"{n} {fixed_text(fixed_bytes([s.types[n]], rows)).removesuffix(' bytes')}" for n in fixed
            )
            + f" ({fixed_text(fixed_bytes([s.types[n] for n in fixed], rows))})",
        )
    if per_row:
        notes.insert(
            2,
            "saved bytes per row: "
            + ", ".join(f"{n} {bytes_per_row([s.types[n]], rows).removesuffix(' bytes')}" for n in per_row),
        )
    if scales:
        notes.append(
            f"fp8 cotangents (fp8_grads={s.fp8_grads}, straight-through): "
            + ", ".join(f"scale {k} in, amax {v} out" for k, v in scales.items())
        )
    copies = [(k, q, sc) for k, (q, sc) in sorted(s.acc_copies.items()) if q in saved_all]
    if copies:
        notes.append(
            "fp8 acc (fp8_acc=True, straight-through): "
            + ", ".join(
                f"stage {k + 1}'s acc read as {q} * (1 / {sc.name if isinstance(sc, Var) else sc.value}), "
                "no copy of acc saved"
                for k, q, sc in copies
            )
        )
    elif s.fp8_acc and any(r.value == "acc" and r.name in saved_all for r in s.reads if r.how == SAVED):
        notes.append(
            "fp8 acc (fp8_acc=True): no stage whose acc is saved stores a scaled fp8 copy of it "
            "(`q: e4m3 = acc * s`), so each is saved as without the option"
        )
    if s.requantize_wgrad and not s.requantized:
        notes.append(
            "requantize_wgrad=True: no weight gradient here reads an operand scaled in 1 x g groups along "
            "its K (`scale_a=` of a block-scaled GEMM), so nothing is quantized again"
        )
    notes += [f"note: {r}" for r in report]
    bwd = Block(
        f"{f.name}_bwd", dims, tuple(params), tuple(outputs), tuple(body), f.span, tuple(notes), derived=True
    )
    detached = frozenset(o.name for o in f.outputs if not s.fwd.is_active(o.name, None))
    return Derived(
        extend_forward(s, saved),
        bwd,
        saved,
        dict(s.cotangents),
        grads,
        report,
        tuple(s.reads),
        scales,
        detached,
    )


def policy_text(s: State, remat: str) -> str:
    """The policy as the header says it: `--remat auto`, and the stages whose source overrides it."""
    stages = [
        f'stage {k + 1}: remat="{st.remat}"'
        for k, st in enumerate(s.fwd.block.stages)
        if st.remat is not None
    ]
    return "; ".join([f"--remat {remat}", *stages])


def extend_forward(s: State, saved: tuple[str, ...]) -> Block:
    """The forward block, storing each saved tensor it doesn't store anyway as an extra output."""
    f = s.fwd.block
    outs = list(f.outputs)
    have = {o.name for o in outs}
    reads = {r.name: r for r in s.reads if r.how == SAVED and r.name in saved}
    acc_read = {r.stage: r for r in reads.values() if r.value == "acc"}
    copies: dict[int, list[Read]] = {}
    for r in reads.values():
        if r.value != "acc" and r.stage is not None:
            copies.setdefault(r.stage, []).append(r)
    body: list[Stmt] = []
    k = -1
    for st in f.body:
        if isinstance(st, Stage):
            k += 1
            extra = []
            if k in acc_read:
                assert st.acc is not None
                name = acc_read[k].name
                extra.append(
                    Eqn("copy", (st.acc,), (Var(name, None, s.fwd.acc_dtype(k)),), (), st.span, (st.span,))
                )
            for r in copies.get(k, []):  # an f32 copy of a tile as computed (State.read_exact)
                extra.append(
                    Eqn("copy", (Var(r.value),), (Var(r.name, None, "f32"),), (), st.span, (st.span,))
                )
            body.append(replace(st, body=st.body + tuple(extra)))
        else:
            body.append(st)
    for name in saved:
        if name in have:
            continue
        r = reads[name]
        span = f.stages[r.stage].span if r.stage is not None else f.span
        outs.append(Output(name, r.type, span))
    notes = tuple(f.notes) + (
        "saved for the backward (extra outputs): " + (", ".join(n for n in saved if n not in have) or "none"),
    )
    return replace(f, body=tuple(body), outputs=tuple(outs), notes=notes)


def _used_dims(params: list[Param], outputs: list[Output], body: list[Stmt]) -> set[str]:
    """The dims a block names (as the parser finds them): in its signature, as values, as `over=`
    parameters and as elementwise stage shapes. A block declares only those."""
    dims: list[Dim] = [d for p in params if p.var.type for d in p.var.type.shape]
    dims += [d for o in outputs for d in o.type.shape]
    for st in body:
        eqns = st.body if isinstance(st, Stage) else (st,)
        if isinstance(st, Stage) and st.shape is not None:
            dims += list(st.shape)
        for e in eqns:
            dims += [a.dim for a in e.ins if isinstance(a, DimRef)]
            dims += [v for _, v in e.params if isinstance(v, Dim)]
    return {d.name for d in dims if d.name}
