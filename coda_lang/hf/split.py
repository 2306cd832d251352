"""A block cut into parts before chosen GEMMs, each such GEMM adding an input tile to its accumulator.

What it does: `split_block(block, before)` gives the parts of a checked block cut before each GEMM
stage whose right operand is a parameter named in `before` (in the order of the body), as the text of
one program (`split_source`) or as checked blocks (`split`). The parts run one after another compute
what the block computes: each part's parameters are the block's parameters it reads and the values
of the parts before it that it reads (a stored tile, with its stored dtype; a row vector); its
outputs are the block's outputs it makes and the values later parts read. The GEMM that starts a
part at a cut adds the parameter `lora_c` (its output's shape, the weight's dtype) to its f32
accumulator before its epilogue reads it (`lora_acc = acc + lora_c`), so that the caller may give it
the output of peft LoRA's adapters, s (x A^T) B^T (lora.py). Given zeros, a part computes what the
block does.
What it does not: decide where to cut (the caller names the weights), or run anything.
Invariants: the parts are checked as any program is (block-locality, types); a value crosses a cut
only as what the language lets a later stage read (a stored tile, or a completed row reduction);
each part's derived backward is the block's, cut where the forward is (autograd chains the parts).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from coda_lang.api import Block, load
from coda_lang.frontend.syntax.printer import print_program
from coda_lang.ir import nodes
from coda_lang.ir.types import Type

# the input a cut GEMM adds to its accumulator, and the sum's name
LORA_C, LORA_ACC = "lora_c", "lora_acc"


def _defined(stmt: nodes.Stmt) -> list[nodes.Var]:
    if isinstance(stmt, nodes.Stage):
        return [v for e in stmt.body for v in e.outs]
    return list(stmt.outs)


def _used(stmt: nodes.Stmt) -> set[str]:
    eqns = stmt.body if isinstance(stmt, nodes.Stage) else (stmt,)
    names = {a.name for e in eqns for a in e.ins if isinstance(a, nodes.Var)}
    if isinstance(stmt, nodes.Stage):
        names |= {a.name for a in (stmt.a, stmt.b) if isinstance(a, nodes.Var)}
        if stmt.acc is not None:
            names.discard(stmt.acc.name)
    return names


def _crossing_type(v: nodes.Var, block: str) -> Type:
    """The type a value made in one part has as an output of it and a parameter of a later one."""
    t = v.type
    assert t is not None
    if v.annot is not None:  # a stored tile
        return Type(v.annot, t.shape, "matrix")
    if t.kind in ("vec", "partial") and len(t.shape) == 1:  # a row vector (a completed reduction)
        return Type(t.dtype, t.shape, "vec")
    if t.kind == "scalar":
        return Type(t.dtype, (), "scalar")
    raise ValueError(f"block {block}: `{v.name}` ({t}) can't cross a cut: not stored, not a row vector")


def split_block(
    block: nodes.Block, before: Iterable[str]
) -> list[tuple[nodes.Block, tuple[str, str] | None]]:
    """The parts of `block` cut before each GEMM whose right operand is a parameter in `before`
    (named `<block>_<i>`, i from 0), each with the names of its first GEMM's operands (x, w) if it
    starts at a cut, else None: a cut GEMM adds `lora_c` [rows, cols] to its accumulator, which the
    caller makes from x (an input of the block, or an output of a part before: an output of that part
    for this reason) and the adapters of w (a parameter of the block)."""
    before = set(before)
    params = {p.var.name: p for p in block.params}
    cuts = [
        i
        for i, s in enumerate(block.body)
        if isinstance(s, nodes.Stage)
        and s.is_gemm
        and isinstance(s.b, nodes.Var)
        and s.b.name in before
        and s.b.name in params
    ]
    missing = before - {block.body[i].b.name for i in cuts}  # type: ignore[union-attr]
    if missing:
        raise ValueError(f"block {block.name}: no GEMM reads {sorted(missing)} as its right operand")
    bounds = [0, *cuts, len(block.body)]
    segments = [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
    # each segment's statements, the cut GEMM adding `lora_c` (`originals`: as in the block)
    bodies: list[list[nodes.Stmt]] = []
    originals: list[list[nodes.Stmt]] = []
    for lo, hi in segments:
        stmts = list(block.body[lo:hi])
        originals.append(list(stmts))
        if lo in cuts:
            st = stmts[0]
            assert isinstance(st, nodes.Stage) and isinstance(st.a, nodes.Var) and isinstance(st.b, nodes.Var)
            if st.ta or not st.tb:
                raise ValueError(f"block {block.name}: the GEMM on {st.b.name} is not `x @ transpose(w)`")
            stmts[0] = _corrected(st)
        bodies.append(stmts)
    outputs = {o.name: o for o in block.outputs}
    defs: dict[str, nodes.Var] = {}
    for stmt in block.body:
        for v in _defined(stmt):
            defs[v.name] = v
    used_after: list[set[str]] = []
    later: set[str] = set(outputs)
    for body in reversed(originals):  # (a cut GEMM's caller reads its operands: they are outputs)
        used_after.append(set(later))
        for stmt in body:
            later |= _used(stmt)
    used_after.reverse()
    parts = []
    for j, body in enumerate(bodies):
        made = [v for stmt in body for v in _defined(stmt)]
        made_names = {v.name for v in made}
        free: list[str] = []
        for stmt in body:
            for n in sorted(_used(stmt)):
                if n not in made_names and n not in free:
                    free.append(n)
        ps: list[nodes.Param] = []
        order = {n: i for i, n in enumerate([*params, LORA_C])}
        for n in sorted(free, key=lambda n: order.get(n, len(order))):
            if n in params:
                ps.append(params[n])
            elif n == LORA_C:
                ps.append(nodes.Param(_lora_param(body[0])))  # type: ignore[arg-type]
            else:
                ps.append(nodes.Param(nodes.Var(n, _crossing_type(defs[n], block.name))))
        outs = [
            outputs[v.name] if v.name in outputs else nodes.Output(v.name, _crossing_type(v, block.name))
            for v in made
            if v.name in used_after[j]
        ]
        first = originals[j][0]
        cut = (
            (first.a.name, first.b.name)  # type: ignore[union-attr]
            if segments[j][0] in cuts
            else None
        )
        parts.append(
            (
                nodes.Block(
                    name=f"{block.name}_{j}",
                    dims=block.dims,
                    params=tuple(ps),
                    outputs=tuple(outs),
                    body=tuple(body),
                    notes=block.notes,
                ),
                cut,
            )
        )
    return parts


def _corrected(st: nodes.Stage) -> nodes.Stage:
    """The cut GEMM with `lora_c` (its output's shape, the weight's dtype) added to its accumulator
    before its epilogue reads it."""
    assert isinstance(st.a, nodes.Var) and isinstance(st.b, nodes.Var) and st.acc is not None
    a_t, b_t = st.a.type, st.b.type
    assert a_t is not None and b_t is not None
    c = nodes.Var(LORA_C, Type(b_t.dtype, (a_t.shape[0], b_t.shape[0]), "matrix"))
    acc = nodes.Var(LORA_ACC)
    body = [nodes.Eqn("add", (nodes.Var(st.acc.name), c), (acc,))]
    for e in st.body:
        ins = tuple(acc if isinstance(a, nodes.Var) and a.name == st.acc.name else a for a in e.ins)
        body.append(nodes.Eqn(e.op, ins, e.outs, e.params, e.span, e.in_spans))
    return replace(st, body=tuple(body))  # (its operands, scales, spans and options as they were)


def _lora_param(st: nodes.Stage) -> nodes.Var:
    """The `lora_c` parameter a corrected GEMM's first equation reads."""
    v = st.body[0].ins[1]
    assert isinstance(v, nodes.Var)
    return v


def split_source(program_dims: tuple[nodes.DimDecl, ...], blocks: list[nodes.Block]) -> str:
    """The .coda text of the parts (every block's), with the program's dims."""
    return print_program(nodes.Program(dims=program_dims, blocks=tuple(blocks)))


def split(
    block: Block, dims: tuple[nodes.DimDecl, ...], before: Iterable[str]
) -> list[tuple[Block, tuple[str, str] | None]]:
    """The checked parts of `block` (a block of a program with dims `dims`) cut before the GEMMs on
    `before`, each with its cut GEMM's operands in the block (`split_block`)."""
    parts = split_block(block.ir, before)
    prog = load(split_source(dims, [p for p, _ in parts]))
    return [(prog[p.name], cut) for p, cut in parts]
