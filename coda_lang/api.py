"""The Python API: `load` a program, index its blocks, print them.

What it does: `Program` (blocks by name) and `Block` (a typed IR block with its plan), the objects
that later layers extend (`Block.run`, `Block.grad`, `Block.cuda`).
What it does not: parse or check by itself (frontend/source.py).
Invariants: a `Program` only exists for text without errors; `str(block)` is .coda source that
loads back to an equal block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from coda_lang.autodiff import AutodiffError, derive
from coda_lang.autodiff.chunk import candidate_plans, choose, chunk_plan, refuse, row_dim
from coda_lang.autodiff.chunk_run import run_chunks
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core.diagnostics import CodaError, Diagnostic, error
from coda_lang.frontend.source import (
    CheckedBlock,
    check_generated,
    check_source,
    normalize_newlines,
    read_source,
)
from coda_lang.frontend.syntax.printer import print_program
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir import nodes
from coda_lang.ir.types import extent


class Block(CheckedBlock):
    """One checked block: `ir` is its typed IR, `plan` what each stage loads, stores and reduces; run
    on the interpreter, differentiated, or made a CUDA block."""

    def __init__(self, ir: nodes.Block, plan: BlockPlan):
        super().__init__(ir, plan)
        self._derivations: dict[tuple[tuple[str, ...] | None, str, str | None, bool, bool], Derivation] = {}
        self._chunk_plans: dict[tuple[tuple[str, ...] | None, str, str], Any] = {}

    def run(
        self,
        inputs: dict[str, Any],
        *,
        dims: dict[str, int] | None = None,
        sim_tile: tuple[int, int] | dict[int, tuple[int, int]] | None = None,
        precision: str = "exact",
    ) -> dict[str, Any]:
        """Run the block on NumPy arrays with the reference interpreter; outputs by name.

        `precision="exact"` follows the kernel's numerics (f32 in stages, stored tiles rounded to
        their dtype); `"f64"` computes everything in float64 without rounding (gradient checks).
        `sim_tile=(tile_M, tile_N)` simulates a kernel's tiling (partials per tile, then combined);
        `sim_tile={stage: (tile_M, tile_N)}` gives each stage its own tile (as `CudaBlock.tiles` does).
        The kernels' own tile is `cuda(tile=)`'s.
        """
        return self.run_with_partials(inputs, dims=dims, sim_tile=sim_tile, precision=precision)[0]

    def run_with_partials(
        self,
        inputs: dict[str, Any],
        *,
        dims: dict[str, int] | None = None,
        sim_tile: tuple[int, int] | dict[int, tuple[int, int]] | None = None,
        precision: str = "exact",
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`run`, plus the per-tile partial buffers of every partial reduction (with a `sim_tile`)."""
        # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
        from coda_lang.interp import (
            PRECISIONS,
            bind,
            run_block,
        )

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        env, sizes = bind(self.ir, inputs, dims, precision)
        return run_block(self.ir, self.plan, env, sizes, precision=precision, sim_tile=sim_tile)

    def derivation(
        self,
        wrt: list[str] | None = None,
        remat: str | None = None,
        *,
        backward: BackwardOptions | None = None,
    ) -> Derivation:
        """Forward block extended to store what the backward reads, and the backward block. `wrt`: the
        parameters to differentiate with respect to (default: every float parameter without a
        default); TypeError or ValueError when it is not a list of this block's parameters.
        `remat`: which forward tiles the backward recomputes rather than reads saved ("auto", "save",
        "recompute"; docs/design.md, "Saved and recomputed"), or `backward=BackwardOptions(...)`."""
        options = BackwardOptions.of(backward, remat=remat)
        remat, fp8_grads, fp8_acc = options.remat, options.fp8_grads, options.fp8_acc
        requant = options.requantize_wgrad
        self._check_wrt(wrt)
        key = (tuple(wrt) if wrt is not None else None, remat, fp8_grads, fp8_acc, requant)
        if key not in self._derivations:
            self._derivations[key] = derive_checked(
                self.ir, self.plan, wrt, remat, fp8_grads, fp8_acc, requant
            )
        return self._derivations[key]

    def _check_wrt(self, wrt: Any) -> None:
        """`wrt=` is None or a list of names of parameters of this block: TypeError, ValueError (a
        parameter the program declares without a gradient, an i32, is the program's E0602)."""
        if wrt is None:
            return
        if (
            isinstance(wrt, str)
            or not isinstance(wrt, (list, tuple))
            or not all(isinstance(w, str) for w in wrt)
        ):
            hint = f" (write wrt=[{wrt!r}])" if isinstance(wrt, str) else ""
            raise TypeError(f"wrt= takes a list of parameter names, got {wrt!r}{hint}")
        params = {p.var.name: p for p in self.ir.params}
        for w in wrt:
            if w not in params:
                raise ValueError(
                    f"wrt= names `{w}`, which is not a parameter of block {self.name} "
                    f"(its parameters: {', '.join(params)})"
                )

    def grad(
        self,
        wrt: list[str] | None = None,
        remat: str | None = None,
        *,
        backward: BackwardOptions | None = None,
    ) -> Block:
        """The backward block (checked): cotangents of the outputs and saved tensors in, one gradient
        per differentiable parameter (float parameters without a default, or `wrt`) out. `remat` or
        `backward=` as `derivation`."""
        return self.derivation(wrt, remat, backward=backward).backward

    def vjp(
        self,
        inputs: dict[str, Any],
        cotangents: dict[str, Any],
        *,
        dims: dict[str, int] | None = None,
        precision: str = "exact",
        sim_tile: tuple[int, int] | dict[int, tuple[int, int]] | None = None,
        wrt: list[str] | None = None,
        backward: BackwardOptions | None = None,
        remat: str | None = None,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
        fp8_grads: str | None = None,
        scales: dict[str, float] | None = None,
        fp8_acc: bool | None = None,
    ) -> dict[str, Any]:
        """Gradients of <outputs, cotangents> w.r.t. each differentiable input, by running the extended
        forward and the derived backward block on the interpreter (both at `sim_tile`, as `run`).
        Keys: parameter names. Outputs without a cotangent get zeros.

        With `fp8_grads=` ("e5m2" or "e4m3"; docs/design.md, "The fp8 backward"), `scales` gives the
        backward's cotangent scales by name (`Derivation.scales`' keys, e.g. "dacc2_scale"; 1.0 where
        not given), and the result also holds, under their names, this step's amax of each quantized
        cotangent (`Derivation.scales`' values, e.g. "dacc2_amax"). With `fp8_acc=True`, each GEMM
        stage that stores a scaled fp8 copy of its acc has its backward read acc from that copy
        (`BackwardOptions.fp8_acc`).

        The backward's options are one `BackwardOptions` (`backward=`), or its fields as keywords
        (`remat=`, `chunk=`, `budget=`, `chunk_dim=`; not both): what the backward recomputes, and
        whether it runs in chunks of one dim (docs/design.md, "Chunked backward"): `chunk` an int
        (elements of that dim per chunk), "auto" (as many as keep the largest transient tile within
        `budget` bytes, default 256 MiB), or None (unchunked; a `budget` or `chunk_dim` alone means
        "auto"). `chunk_dim`: the dim (its name: "M" for rows, "V" for a vocabulary's columns); by
        default the forward's row dim for an int chunk, and for "auto" the dim whose chunked run holds
        the least memory (the columns of V for an LM head, whose wgrad would otherwise accumulate a
        [D, V] f32 sum over the rows). Gradients summed over the chunked dim accumulate across chunks
        unrounded and are rounded once. A bad argument raises TypeError or ValueError; a backward that
        can't run in chunks of that dim, CodaError E0809."""
        options = BackwardOptions.of(
            backward,
            remat=remat,
            chunk=chunk,
            budget=budget,
            chunk_dim=chunk_dim,
            fp8_grads=fp8_grads,
            fp8_acc=fp8_acc,
        )
        d = self.derivation(wrt, backward=options.unchunked())
        unknown = sorted(set(scales or {}) - set(d.scales))
        if unknown:
            raise ValueError(
                f"scales= names `{unknown[0]}`, which is not a cotangent scale of this backward "
                f"(its scales: {', '.join(d.scales) or 'none; fp8_grads= makes them'})"
            )
        fwd = d.forward.run_with_partials(inputs, dims=dims, sim_tile=sim_tile, precision=precision)[0]
        bins, bdims = self.backward_inputs(d, inputs, cotangents, fwd, dims, precision)
        for name in d.scales:
            bins[name] = float((scales or {}).get(name, 1.0))
        if not options.chunked:
            grads = d.backward.run(bins, dims=bdims, sim_tile=sim_tile, precision=precision)
        else:
            grads = self._chunked_backward(wrt, options, bins, bdims, sim_tile, precision)
        out = {p: grads[g] for p, g in d.grads.items()}
        out.update({a: grads[a] for a in d.scales.values()})
        return out

    def backward_inputs(
        self,
        d: Derivation,
        inputs: dict[str, Any],
        cotangents: dict[str, Any],
        fwd: dict[str, Any],
        dims: dict[str, int] | None,
        precision: str = "exact",
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """The inputs of `d`'s backward block (the cotangents, zeros for outputs without one; saved
        tensors from the extended forward's outputs `fwd`; parameters) and its dims."""
        import numpy as np

        # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
        from coda_lang.interp import bind

        _, sizes = bind(self.ir, inputs, dims, precision)
        outputs = {o.name: o for o in self.ir.outputs}
        unknown = sorted(set(cotangents) - set(outputs))
        if unknown:
            raise error(
                "E0801", f"no output `{unknown[0]}` to take a cotangent of; outputs: {', '.join(outputs)}"
            )
        bins: dict[str, Any] = {}
        for out_name, ct_name in d.cotangents.items():
            if out_name in cotangents:
                bins[ct_name] = cotangents[out_name]
            else:
                o = outputs[out_name]
                bins[ct_name] = np.zeros(tuple(extent(x, sizes) for x in o.type.shape), np.float32)
        names = {p.var.name for p in d.backward.ir.params}
        for name in names - set(bins):
            bins[name] = fwd[name] if name in fwd else inputs.get(name)
            if bins[name] is None:
                bins.pop(name)  # a parameter with a default
        bdims = {x.name: sizes[x.name] for x in d.backward.ir.dims}  # the backward declares the dims it uses
        return bins, bdims

    def chunk_plan(
        self, wrt: list[str] | None = None, remat: str | None = None, chunk_dim: str | None = None
    ) -> Any:
        """How the derived backward runs in chunks of `chunk_dim` (default: the forward's row dim, its
        first stage's rows): an `autodiff.chunk.ChunkPlan`; CodaError E0809 where it can't."""
        remat = BackwardOptions.of(remat=remat).remat
        if chunk_dim is None:
            chunk_dim = row_dim(self.ir)
            if chunk_dim is None:
                raise refuse(f"block {self.name} has no stage whose rows could be chunked")
        key = (tuple(wrt) if wrt is not None else None, remat, chunk_dim)
        if key not in self._chunk_plans:
            d = self.derivation(wrt, remat)
            self._chunk_plans[key] = chunk_plan(d.backward, chunk_dim)
        return self._chunk_plans[key]

    def _chunked_backward(
        self,
        wrt: list[str] | None,
        options: BackwardOptions,
        bins: dict[str, Any],
        bdims: dict[str, int],
        sim_tile: Any,
        precision: str,
    ) -> dict[str, Any]:
        import numpy as np  # lazy: `coda check` and `coda grad` never import NumPy

        # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
        from coda_lang.core.numerics import (
            round_to,
            to_storage,
        )

        # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
        from coda_lang.interp import (
            bind,
            run_block,
        )

        d = self.derivation(wrt, options.remat)
        plans = candidate_plans(self, wrt, options)
        env, sizes = bind(d.backward.ir, bins, bdims, precision)
        plan, c = choose(plans, sizes, options)

        def run(sub: dict[str, Any], n: int, acc: bool) -> dict[str, Any]:
            dims = {**sizes, plan.inner: n}
            wide = plan.acc_block if acc else plan.block
            assert wide is not None  # (acc only where the plan has an acc_block)
            return run_block(wide.ir, wide.plan, sub, dims, precision=precision, sim_tile=sim_tile)[0]

        def empty(part: Any, shape: tuple[int, ...]) -> Any:
            return np.empty(shape, np.asarray(part).dtype)

        def add(total: Any, part: Any) -> Any:
            with np.errstate(all="ignore"):  # (inf + -inf among special inputs: NaN, as unchunked)
                if isinstance(total, np.ndarray) and total.ndim and total.flags.writeable:
                    return np.add(total, part, out=total)
                return total + part

        def finish(total: Any, dtype: str) -> Any:
            return to_storage(round_to(total, dtype, precision), dtype, precision)

        return run_chunks(plan, env, sizes[plan.dim], c, run, empty, add, finish)

    def cuda(
        self,
        *,
        tile: Any = None,
        dims: dict[str, int] | None = None,
        emulate: bool = False,
        poison: bool = False,
        tune: bool | None = None,
    ) -> Any:
        """The block as a callable on torch CUDA tensors (`coda_lang.backend_cute.runtime.cuda_block.CudaBlock`):
        one quack kernel per GEMM stage, tiny torch ops between stages. `tile`, the kernels' tile: None
        (each stage's tile chosen by `select_config`), `(tile_M, tile_N)` or a `TileConfig` for every
        stage, or a dict {stage: tile}. `dims`: sizes of dims no input's shape gives (as `run(...,
        dims=)`; a call may give them too). `emulate`: each kernel replaced by its torch stand-in (any
        device); `poison`: outputs filled with NaN before each launch (tests); `tune`: time the
        candidate tiles at each shape (default: on a GPU, unless $CODA_TUNE=0). Raises CodaError (E07)
        for stages the backend can't run yet."""
        # lazy: imports torch, which `coda check`, `coda run` and `import coda_lang` never load
        from coda_lang.backend_cute.runtime.cuda_block import (
            CudaBlock,
        )

        return CudaBlock(self, tile=tile, dims=dims, emulate=emulate, poison=poison, tune=tune)


class Program:
    def __init__(self, ir: nodes.Program, plans: dict[str, BlockPlan], source: str):
        self.ir = ir
        self.source = source
        self.blocks = {b.name: Block(b, plans[b.name]) for b in ir.blocks}

    @property
    def file(self) -> str:
        return self.ir.file

    def __getitem__(self, name: str) -> Block:
        try:
            return self.blocks[name]
        except KeyError:
            raise KeyError(f"no block `{name}` in {self.file}; blocks: {', '.join(self.blocks)}") from None

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks.values())

    def __len__(self) -> int:
        return len(self.blocks)

    def __str__(self) -> str:
        return print_program(self.ir)

    def __repr__(self) -> str:
        return f"<coda Program {self.file}: {', '.join(self.blocks)}>"


@dataclass
class Derivation:
    """What `coda grad` derives: the extended forward, the backward, and how they connect."""

    forward: Block  # the forward block, storing the saved tensors as extra outputs
    backward: Block
    saved: tuple[str, ...]  # forward values the backward reads
    cotangents: dict[str, str]  # forward output -> backward parameter holding its cotangent
    grads: dict[str, str]  # forward parameter -> backward output holding its gradient
    report: list[str]  # e.g. stages whose backward runs as an elementwise stage
    # fp8 cotangents (BackwardOptions.fp8_grads): each scale (a scalar input of the backward) -> the
    # backward output holding this step's amax of that cotangent
    scales: dict[str, str] = field(default_factory=dict)
    # outputs no gradient flows back from (made through `detach`, or from no differentiated
    # parameter): their cotangents reach nothing
    detached: frozenset[str] = frozenset()


def derive_checked(
    ir: nodes.Block,
    plan: BlockPlan,
    wrt: list[str] | None = None,
    remat: str = nodes.DEFAULT_REMAT,
    fp8_grads: str | None = None,
    fp8_acc: bool = False,
    requantize_wgrad: bool = False,
) -> Derivation:
    """Derive the backward block and check both blocks; CodaError (E06) where it can't."""
    try:
        d = derive(ir, plan, wrt, remat, fp8_grads, fp8_acc, requantize_wgrad)
    except AutodiffError as e:
        raise CodaError([Diagnostic(e.code, e.message, e.span, notes=e.notes)]) from None
    blocks = [check_generated(b, "the derived block", ir.span) for b in (d.forward, d.backward)]
    return Derivation(
        Block(blocks[0].ir, blocks[0].plan),
        Block(blocks[1].ir, blocks[1].plan),
        d.saved,
        d.cotangents,
        d.grads,
        d.report,
        dict(d.scales),
        d.detached,
    )


def load(path_or_text: str | os.PathLike[str]) -> Program:
    """Parse and check a .coda file (a path) or source text; raises CodaError carrying the diagnostics."""
    text, file = read_source(path_or_text)
    prog, plans, diags = check_source(text, file)
    if prog is None:
        raise CodaError(diags, {file: normalize_newlines(text)})
    return Program(prog, plans, text)
