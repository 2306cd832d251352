"""Epilogue emission: a `StageSpec` -> the Python source of one quack `@gemm_epilogue` function.

What it does: writes straight-line code, one assignment per live equation, through each op's `emit`
rule in the registry (coda_lang/ops); pins every operand, output and reduction explicitly in the
decorator (`ops=`, `outputs=`, `reduces=`/`outs=`, `extra_ops=`, `mode=`: quack infers nothing);
in "acc_pair" mode splits every full-width value into its two lanes (adjacent columns), in
"packed_cd_b16x2" mode every double-width value (the C operand `c`, D, what lies between), so that
each statement is scalar f32 code. A stage with grouped reductions gets a second function, the
prepass (`prepass=`, `prepass_outs=`): scalar code over single accumulator elements that returns what
each `GroupedReduce` op folds; the main fn then receives each group's fold as a parameter (a Pair in
acc_pair mode, both lanes holding it: lane 0 is read). `module_name` names the content-addressed file
the kernel cache keeps the source in (build/store.py's `write_source`: quack fingerprints an epilogue
by its source file, so it must be real).
What it does not: import quack or CuTeDSL (the emitted module does, when quack_adapter loads it).
Invariants: the same spec gives the same text (golden files in tests/golden/emit), and so does a stage
of the same meaning in another block (its names are the stage's own: plan/context.py; the header
says nothing of where it stands), so such stages share a module and their kernels; the file name is
the hash of the text and EMITTER_VERSION, so a file is never rewritten with other contents.
"""

from __future__ import annotations

import hashlib
import keyword
import re

from coda_lang.backend_cute.plan import names as module_names
from coda_lang.backend_cute.plan import spec as specs
from coda_lang.backend_cute.plan.spec import (
    FP8_WORDS,
    INDEX_AXIS,
    WORDS,
    Group,
    Output,
    StageSpec,
    describe,
    dim_operand,
)
from coda_lang.core.diagnostics import CodaError, Diagnostic, Mistake
from coda_lang.ir.nodes import Atom, DimRef, Eqn, Lit, Var
from coda_lang.ir.types import FP8_MAX, is_fp8
from coda_lang.ops import REGISTRY, Locality

EMITTER_VERSION = "4"

# a numbered temporary in the header's coda text (not inside a longer name: `v_t3`, `_t3_0` are Python's)
_TEMP = re.compile(r"(?<![\w])_t\d+(?![\w])")

_CUTLASS_DTYPES = {"f32": "Float32", "bf16": "BFloat16", "f16": "Float16", "i32": "Int32"}


def source_hash(source: str) -> str:
    return hashlib.sha256(f"coda-emitter-{EMITTER_VERSION}\n{source}".encode()).hexdigest()


def module_name(source: str) -> str:
    return f"coda_epi_{source_hash(source)[:24]}"


class _Emitter:
    """The main fn of a stage, or (`prepass=True`) its prepass fn: one lane per value, always."""

    def __init__(self, spec: StageSpec, prepass: bool = False):
        self.spec, self.prepass = spec, prepass
        self.lines: list[str] = []
        self.lanes: dict[str, tuple[str, ...]] = {}  # coda name -> one expression per lane
        self.taken: set[str] = (
            set(spec.names.values())
            | {"acc", spec.fn_name, spec.prepass_name}
            | module_names.helper_names()
            | {g.out for g in spec.groups if g.out}
        )
        self.py: dict[str, str] = dict(spec.names)  # coda name -> Python name, for every value
        for e in spec.prepass if prepass else spec.eqns:
            for v in e.outs:
                if v.name not in self.py:
                    name = spec.temps.get(v.name, v.name)  # (a temporary by its number in the stage)
                    base = (
                        f"v_{name}"
                        if name in module_names.helper_names() or keyword.iskeyword(name)
                        else name
                    )
                    self.py[v.name] = self.fresh(base)

    def fresh(self, base: str) -> str:
        name = base
        while name in self.taken:
            name += "_"
        self.taken.add(name)
        return name

    def atom(self, a: Atom, lane: int) -> str:
        if isinstance(a, Var):
            lanes = self.lanes[a.name]
            return lanes[lane] if len(lanes) > 1 else lanes[0]
        if isinstance(a, Lit):
            return repr(float(a.value))
        if isinstance(a, DimRef) and a.dim.name is not None:  # a Scalar operand with the dim's size
            size = self.py[dim_operand(a.dim.name)]
            c = a.dim.coeff
            return size if c == 1 else f"({size} * {float(c)!r})"
        raise AssertionError(a)  # plan.py rejects constant extents and poisoned atoms

    def bind(self, name: str, n: int) -> tuple[str, ...]:
        py = self.py[name]
        return (py,) if n == 1 else tuple(self.fresh(f"{py}_{i}") for i in range(n))

    def eqn(self, e: Eqn) -> None:
        od = REGISTRY[e.op]
        emit = od.lower.cute
        assert emit is not None
        params = dict(e.params)
        if od.locality is Locality.PAIR:  # on lanes (`Lanes`): operands' lanes -> each result's lanes
            args = [self.lanes_of(a) for a in e.ins]
            results = emit(*args)
            targets: list[str] = []
            exprs: list[str] = []
            for v, lanes in zip(e.outs, results, strict=True):
                names = self.bind(v.name, len(lanes))
                self.lanes[v.name] = names
                targets += names
                exprs += lanes
            self.lines.append(f"{', '.join(targets)} = {', '.join(exprs)}")
            return
        (v,) = e.outs
        n = 1 if self.prepass else self.spec.lanes(v.type)
        names = self.bind(v.name, n)
        for i, target in enumerate(names):
            self.lines.append(f"{target} = {emit(*[self.atom(a, i) for a in e.ins], **params)}")
        self.lanes[v.name] = names

    def saturate(self, name: str, dtype: str) -> None:
        """An fp8 stored value clamped to the dtype's finite range, infinities included (NaN stays NaN:
        the NaN-propagating max and min), as the interpreter's store does (core/numerics.round_fp8);
        quack's store then rounds it to nearest even (`cvt.rn.satfinite.e4m3x2.f32`, which on a value
        in range only rounds). The clamp is written out rather than left to the cvt's saturation, so
        that what reaches the cvt is finite or NaN whatever the cvt does with an infinity."""
        m = FP8_MAX[dtype]
        lanes = []
        for x in self.lanes[name]:
            target = self.fresh(f"{x}_sat")
            lo = f"cute.math.max({x}, {-m!r}, propagate_nan=True)"
            self.lines.append(f"{target} = cute.math.min({lo}, {m!r}, propagate_nan=True)")
            lanes.append(target)
        self.lanes[name] = tuple(lanes)

    def lanes_of(self, a: Atom) -> tuple[str, ...]:
        if isinstance(a, Var):
            return self.lanes[a.name]
        return (self.atom(a, 0),)

    def value(self, name: str, pad: str | None = None, negate: bool = False) -> str:
        """A result for the return dict: a Pair in acc_pair mode when `pad` says how to fill lane 2
        (`negate`: each lane negated, what a min() sink folds by max)."""
        lanes = self.lanes[name]
        if negate:
            lanes = tuple(f"-{x}" for x in lanes)
        if pad in ("add", "max"):  # packed mode: a sink folds the two lanes of a double-width value
            return (
                f"{lanes[0]} + {lanes[1]}"
                if pad == "add"
                else f"cute.math.max({lanes[0]}, {lanes[1]}, propagate_nan=True)"
            )
        if len(lanes) == 2:
            return f"pack({lanes[0]}, {lanes[1]})"
        if pad is None:
            return lanes[0]
        return f"pack({lanes[0]}, {lanes[0] if pad == 'self' else pad})"

    def equations(self, eqns: tuple[Eqn, ...]) -> None:
        for e in eqns:
            try:
                self.eqn(e)
            except Mistake as m:
                raise CodaError([Diagnostic(m.code, m.message, e.span, notes=m.notes, help=m.help)]) from None

    def prepass_fn(self) -> list[str]:
        """The prepass: `def <fn>_prepass(acc, <operands it reads>)`, one scalar per element."""
        spec = self.spec
        self.lanes["acc"] = ("acc",)
        for o in spec.operands:
            self.lanes[o.name] = (f"{o.py}(acc)",) if o.role in INDEX_AXIS else (o.py,)
        self.equations(spec.prepass)
        read = {a.name for e in spec.prepass for a in e.ins if isinstance(a, Var)} | {
            g.value for g in spec.groups
        }
        params = ["acc"] + [o.py for o in spec.operands if o.name in read]
        ret = ", ".join(f'"{g.py}": {self.lanes[g.value][0]}' for g in spec.groups)
        body = self.lines + ["return {" + ret + "}"]
        return [f"def {spec.prepass_name}({', '.join(params)}):"] + [f"    {line}" for line in body]

    def run(self) -> str:
        spec = self.spec
        if spec.plain:
            return self.plain_module()
        body: list[str] = []
        if spec.paired:
            a0, a1 = self.fresh("acc_0"), self.fresh("acc_1")
            self.lanes["acc"] = (a0, a1)
            body.append(f"{a0}, {a1} = unpack(acc)")
        else:
            self.lanes["acc"] = ("acc",)
        for o in spec.operands:
            if o.lanes == 2:
                l0, l1 = self.fresh(f"{o.py}_0"), self.fresh(f"{o.py}_1")
                if o.host in (WORDS, FP8_WORDS):  # pairs loaded as words (f32 of 16-bit, int16 of fp8)
                    self.lanes[o.name] = (l0, l1)
                    body.append(f"{l0}, {l1} = unpack_{o.dtype}x2({o.py})")
                    continue
                # a column vector passed repeat_interleave(2): one value per pair, both lanes hold it
                self.lanes[o.name] = (l0,) if o.host else (l0, l1)
                body.append(f"{l0}, {l1} = unpack({o.py})")
            elif o.role in INDEX_AXIS:  # TileIndex, an apply port: called where the index is used
                self.lanes[o.name] = (f"{o.py}(acc)",)
            else:
                self.lanes[o.name] = (o.py,)
        saturated: set[str] = set()
        for g in spec.groups:  # a value port: each element's group fold (a Pair of equal lanes when paired)
            if spec.paired:
                l0, l1 = self.fresh(f"{g.py}_0"), self.fresh(f"{g.py}_1")
                self.lanes[g.name] = (l0,)
                body.append(f"{l0}, {l1} = unpack({g.py})")
            else:
                self.lanes[g.name] = (g.py,)
        self.equations(spec.eqns)
        for out in ((spec.d,) if spec.d is not None else ()) + spec.outputs:
            if is_fp8(out.dtype) and out.name not in saturated:
                saturated.add(out.name)
                self.saturate(out.name, out.dtype)
            elif out.narrow is not None and out.name not in saturated:
                # (an fp8 D stored in bf16 or f16: clamped as the fp8 store is, then rounded to odd,
                # so that the runtime's rounding of it to the fp8 dtype is the direct rounding's)
                saturated.add(out.name)
                self.saturate(out.name, out.narrow)
                lanes = []
                for x in self.lanes[out.name]:
                    target = self.fresh(f"{x}_odd")
                    self.lines.append(f"{target} = round_odd_{out.dtype}({x})")
                    lanes.append(target)
                self.lanes[out.name] = tuple(lanes)
        body += self.lines
        ret: list[str] = []
        if spec.d is not None:
            ret.append(f'"D": {self.value(spec.d.name)}')
        for out in spec.outputs:
            if out.pairs:  # both lanes' fp8 codes in one word (epi_ops.pack_<dtype>x2)
                lo, hi = self.lanes[out.name]
                ret.append(f'"{out.py}": pack_{out.dtype}x2({lo}, {hi})')
                continue
            ret.append(
                f'"{out.py}": {self.lanes[out.name][out.lane] if out.lane is not None else self.value(out.name)}'
            )
        for s in spec.sinks:
            if s.scaled:
                ret.append(f'"{s.py}": ({", ".join(self.value(n) for n in s.value)})')
            elif s.lanes == 2:
                ret.append(f'"{s.py}": {self.value(s.value[0], s.combine, s.negate)}')
            elif s.op == "OnlineLSEReduce" and specs.LSE_CLAMP:  # +-inf folded as +-F32_MAX (spec.LSE_CLAMP)
                v = self.value(s.value[0])
                big = f"Float32({specs.F32_MAX!r})"
                clamped = f"cute.math.min({v}, {big}, propagate_nan=True)"
                ret.append(f'"{s.py}": cute.math.max({clamped}, -{big}, propagate_nan=True)')
            else:
                ret.append(f'"{s.py}": {self.value(s.value[0], s.pad if spec.paired else None, s.negate)}')
        body.append("return {" + ", ".join(ret) + "}")
        return self.module(body)

    def decorator(self) -> list[str]:
        spec = self.spec
        args: list[str] = []
        if spec.outputs:
            outs = ", ".join(_tile_store(o) for o in spec.outputs)
            args.append(f"outputs=({outs}{',' if len(spec.outputs) == 1 else ''})")
        if any(o.op != "C" for o in spec.operands) or spec.groups:
            ops = []
            for o in spec.operands:
                if o.op == "C":
                    continue  # quack's reserved `c`: the GEMM's C operand, not an epilogue op
                extra = f", dtype={_CUTLASS_DTYPES[o.dtype]}" if o.op == "Scalar" and o.dtype != "f32" else ""
                if o.role in INDEX_AXIS:
                    extra = f", axis={INDEX_AXIS[o.role]}"
                if o.op == "GroupColumnLoad":
                    extra = f", group={o.group}"
                ops.append(f'"{o.py}": {o.op}("{o.py}"{extra})')
            ops += [f'"{g.py}": {_grouped(g)}' for g in spec.groups]
            args.append("ops={" + ", ".join(ops) + "}")
        if spec.groups:
            names = ", ".join(f'"{g.py}"' for g in spec.groups)
            args.append(
                f"prepass={spec.prepass_name}, prepass_outs=({names}{',' if len(spec.groups) == 1 else ''})"
            )
        reduces = [s for s in spec.sinks if s.op in ("ColVecReduce", "RowVecReduce")]
        outs_ = [s for s in spec.sinks if s.op not in ("ColVecReduce", "RowVecReduce")]
        if reduces:
            items = []
            for s in reduces:
                kw = "".join(
                    [
                        f', combine="{s.combine}"' if s.combine != "add" else "",
                        ", scaled=True" if s.scaled else "",
                        ", ragged_only=True" if s.ragged_only else "",
                    ]
                )
                items.append(f'"{s.py}": {"Bounded" if s.bounded else ""}{s.op}("{s.py}"{kw})')
            args.append("reduces={" + ", ".join(items) + "}")
        extra_ops = [f'{_grouped(g)}.out("{g.out}")' for g in spec.groups if g.out]
        if outs_:
            items = []
            for s in outs_:
                if s.op == "ColVecSelect":
                    idx = f"_{spec.fn_name}_{s.index}"
                    items.append(f'"{s.py}": BoundedColVecSelect("{s.py}", idx_op={idx})')
                    extra_ops.append(idx)
                else:
                    items.append(f'"{s.py}": {s.op}("{s.py}")')
            args.append("outs={" + ", ".join(items) + "}")
        gemm = spec.gemm
        if gemm.scaled:  # the block scales, carried to the mainloop (the fn never reads them)
            kn = (", kn=True" if gemm.b_kn else "") + (", columns=True" if gemm.b_columns else "")
            if gemm.scale_a is not None:
                extra_ops.append(f'BlockScale("{gemm.scale_a_py}", "a", "{gemm.scale_b_py}"{kn})')
            extra_ops.append(f'BlockScale("{gemm.scale_b_py}", "b", "{gemm.scale_a_py}"{kn})')
        if extra_ops:
            args.append(f"extra_ops=({', '.join(extra_ops)}{',' if len(extra_ops) == 1 else ''})")
        if spec.quack_mode != "element":
            args.append(f'mode="{spec.quack_mode}"')
        one_line = f"@gemm_epilogue({', '.join(args)})"
        if len(one_line) <= 100:
            return [one_line]
        return ["@gemm_epilogue("] + [f"    {a}," for a in args] + [")"]

    def plain_module(self) -> str:
        """A bare GEMM's module: nothing of the stage in it (not even its name), so that every plain
        stage with these operand dtypes and majors shares its file, its kernels and its tuning."""
        g = self.spec.gemm
        a = f"transpose(a): {g.a_dtype}[K, M]" if g.ta else f"a: {g.a_dtype}[M, K]"
        b = f"transpose(b): {g.b_dtype}[N, K]" if g.tb else f"b: {g.b_dtype}[K, N]"
        return "\n".join(
            [
                f'"""coda_lang epilogue: a bare GEMM, D = acc: {a} @ {b} -> D {g.a_dtype}[M, N].',
                "",
                "Generated by coda_lang.backend_cute (emitter version "
                f"{EMITTER_VERSION}); do not edit: the file name is the hash of its text.",
                "Shared by every stage that only stores its GEMM's result in the operands' dtype.",
                '"""',
                "",
                "from quack.epilogue.frontend import gemm_epilogue",
                "",
                "",
                "@gemm_epilogue()",
                f"def {self.spec.fn_name}(acc):",
                '    return {"D": acc}',
                "",
            ]
        )

    def module(self, body: list[str]) -> str:
        spec = self.spec
        # nothing of where the stage stands: no source line (a comment added above the stage recompiled
        # every kernel), no block name or stage index, temporaries by their number in the stage (a
        # stage two blocks share, a layer's MLP and the last layer's, is one module and one kernel)
        head = [
            f'"""coda_lang epilogue of `{spec.text}`.',
            "",
            "Generated by coda_lang.backend_cute (emitter version "
            f"{EMITTER_VERSION}); do not edit: the file name is the hash of its text.",
            "Shared by every stage, of any block, that reads as this one.",
            "",
        ]
        head += describe(spec)
        head += ["", "coda source:"] + [f"    {line}" for line in spec.source]
        head = [_TEMP.sub(lambda m: spec.temps.get(m.group(), m.group()), line) for line in head]
        head.append('"""')
        pre: list[str] = []
        for s in spec.sinks:
            if s.op == "ColVecSelect":
                pre.append(f'_{spec.fn_name}_{s.index} = ColVecLoad("{s.index}")')
        deco = self.decorator()
        params = ", ".join(["acc"] + [o.py for o in spec.operands] + [g.py for g in spec.groups])
        fn = deco + [f"def {spec.fn_name}({params}):"] + [f"    {line}" for line in body]
        if spec.groups:
            fn = _Emitter(spec, prepass=True).prepass_fn() + ["", ""] + fn
        code = "\n".join(pre + fn)
        table = module_names.imports()
        used = sorted(name for name in table if re.search(rf"(?<![\w.]){re.escape(name)}\b", code))
        plain = sorted({table[n] for n in used if table[n].startswith("import ")})
        froms: dict[str, list[str]] = {}
        for n in used:
            line = table[n]
            if line.startswith("from "):
                froms.setdefault(line.split()[1], []).append(n)
        imports = plain + [
            f"from {m} import {', '.join(sorted(ns))}"
            for m, ns in sorted(froms.items())
            if not m.startswith("coda_lang")
        ]
        ours = [
            f"from {m} import {', '.join(sorted(ns))}"
            for m, ns in sorted(froms.items())
            if m.startswith("coda_lang")
        ]
        if ours:  # first-party, a block of its own (isort's order)
            imports += [""] + ours
        text = "\n".join(head) + "\n\n" + "\n".join(imports) + "\n"
        if pre:
            text += "\n" + "\n".join(pre) + "\n"
        return text + "\n\n" + "\n".join(fn) + "\n"


def _tile_store(o: Output) -> str:
    """The store op of a TileStore output: quack's TileStore, gated for a half-width one; our
    GatedFp8Store (gated_store.py) for a half-width fp8 one, which quack's asserts 16-bit on SM90."""
    if o.gated and o.lane is None and is_fp8(o.dtype):
        return f'GatedFp8Store("{o.py}")'
    if o.pairs:  # a 16-bit word per element (its fp8 pairs): quack's plain TileStore
        return f'TileStore("{o.py}")'
    return f'TileStore("{o.py}"{", gated=True" if o.gated else ""})'


def _grouped(g: Group) -> str:
    """The GroupedReduce op of a group (epi_ops.py)."""
    combine = f', combine="{g.combine}"' if g.combine != "add" else ""
    return f'GroupedReduce("{g.py}"{combine})'


def emit_stage(spec: StageSpec) -> str:
    """The source of the stage's epilogue module (raises CodaError E07 where an op can't be emitted)."""
    return _Emitter(spec).run()
