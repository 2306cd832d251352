"""coda blocks as torch functions and modules, with autograd, on any device.

What it does: `function(block)` makes a block a differentiable function of torch tensors: on a Hopper
GPU (compute capability 9.0) each GEMM stage is one fused CuTeDSL kernel, its backward the derived
backward block's kernels; on any other device (a CPU, another GPU) the same stages run as their torch
stand-ins with the kernels' numerics (f32 inside a stage, stored tiles rounded to their dtype), so a
CPU machine and CI take the same code path as the GPU. `BlockModule` is a `torch.nn.Module` that owns
some of a block's inputs as parameters; `LlamaMLP` is the LLaMA layer's out-proj + residual + RMSNorm +
SwiGLU MLP + residual as one such module, its text `llama_mlp_source` (`llama_mlp_stages`: the one
source of the LLaMA MLP, also of coda_lang.hf's blocks and of examples/llama_mlp.coda).
What it does not: choose between fused and unfused math (a block is what its .coda text says), or
fall back silently: a block the GPU backend can't compile raises the backend's CodaError (E07) on its
first call on the GPU.
Invariants: gradients flow to every floating-point input that requires grad, in that input's dtype;
`$CODA_EMULATE=1` forces the stand-ins on a Hopper GPU too (debugging: the two paths must agree).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from coda_lang.api import Block, load
from coda_lang.autodiff.chunk import candidate_plans
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.runtime.capture import CaptureError
from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling, check_grad_scales
from coda_lang.backend_cute.runtime.tiles import precompile as compile_blocks

__all__ = [
    "BlockFunction",
    "BlockModule",
    "CaptureError",
    "DelayedScaling",
    "LlamaMLP",
    "compile_together",
    "fp8_weight",
    "function",
    "llama_mlp_source",
    "llama_mlp_stages",
    "llama_mlp_stages_fp8",
    "precompile",
    "uses_kernels",
    "wait_for_kernels",
]


def uses_kernels(device: torch.device | str) -> bool:
    """Whether blocks run as CuTeDSL kernels on `device` (a Hopper GPU) rather than as torch stand-ins."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("CODA_EMULATE", "0") == "1":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def _as_block(block: Block | str, name: str | None) -> Block:
    if isinstance(block, Block):
        return block
    if not isinstance(block, str):
        raise TypeError(f"expected a coda Block or .coda source text or path, got {type(block).__name__}")
    prog = load(block)
    if name is not None:
        return prog[name]
    if len(prog) != 1:
        raise ValueError(f"{prog.file} has {len(prog)} blocks ({', '.join(prog.blocks)}); pass name=")
    return next(iter(prog))


class BlockFunction:
    """A block as a differentiable torch function: `f(**tensors)` (or `f({name: tensor})`) returns the
    block's outputs by name. Made by `function(block)`.

    The runtime is chosen per call by the device of the tensors: kernels on a Hopper GPU, torch
    stand-ins elsewhere (`uses_kernels`). Outputs of a call whose inputs require grad have a backward
    through the derived backward block (`remat` says what that backward recomputes rather than reads
    saved; docs/design.md, "Saved and recomputed"). `dims`: sizes of dims no input's shape gives.
    `chunk`: run the backward in chunks of one dim (a number per chunk, or "auto": as many as keep its
    largest transient tile within `budget` bytes, default 256 MiB; docs/design.md, "Chunked
    backward"), so that a loss head's [rows, V] dlogits is never whole; gradients summed over the
    chunked dim accumulate in f32. `chunk_dim`: that dim's name ("M", "V"); by default the forward's
    row dim for a number, and for "auto" the dim whose run holds the least memory (V for an LM head).
    `grad_scales`: with `BackwardOptions(fp8_grads=...)`, the `DelayedScaling` keeping the delayed
    scales of the backward's fp8 cotangents (required then); each backward runs at its current scales
    and records its amaxes, which set the next step's (docs/design.md, "The fp8 backward"). A call may
    pass its own (`f(..., grad_scales=s)`): one per call site when one function serves several layers.
    """

    def __init__(
        self,
        block: Block,
        *,
        wrt: list[str] | None = None,
        backward: BackwardOptions | None = None,
        remat: str | None = None,
        tile: Any = None,
        dims: dict[str, int] | None = None,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
        grad_scales: DelayedScaling | None = None,
    ):
        self.options = BackwardOptions.of(
            backward, remat=remat, chunk=chunk, budget=budget, chunk_dim=chunk_dim
        )
        self.block, self.wrt, self.tile, self.dims = block, wrt, tile, dims
        self.remat = self.options.remat
        self._fns: dict[bool, Any] = {}  # emulate? -> CudaFunction
        # functions whose kernels compile with this one's, at the first call of any (compile_together)
        self._together: list[BlockFunction] = [self]
        # derive now: an error shows when the function is made
        d = block.derivation(wrt, backward=self.options.unchunked())
        # fp8 cotangents: their delayed scales (required then), bound to this backward's scale names
        self.grad_scales = check_grad_scales(grad_scales, self.options, d, block.name)
        if self.options.chunked:  # and a backward that can't run in chunks is refused now
            candidate_plans(block, wrt, self.options)

    @property
    def name(self) -> str:
        return self.block.name

    def __repr__(self) -> str:
        return f"<coda function {self.name} (remat={self.remat})>"

    def _made(self, emulate: bool) -> Any:
        fn = self._fns.get(emulate)
        if fn is None:
            cb = self.block.cuda(tile=self.tile, dims=self.dims, emulate=emulate)
            fn = self._fns[emulate] = cb.autograd(
                self.wrt, backward=self.options, grad_scales=self.grad_scales
            )
        return fn

    def _fn(self, emulate: bool) -> Any:
        fresh = emulate not in self._fns
        fn = self._made(emulate)
        if fresh and not emulate:
            # the kernels of the functions compiled together with this one (forward, backward, chunked
            # backwards) join this one's first compile: one pool of workers for all (tiles.precompile
            # does each block once, so their own first calls find them compiled)
            for g in self._together:
                if g is not self:
                    fn.forward.compile_with(*g.kernel_blocks())
        return fn

    def kernel_blocks(self) -> list[Any]:
        """The CUDA blocks of this function's kernels: its forward, its backward and each chunked
        backward (made now if they were not; compiled at the first call, or by `precompile`)."""
        fn = self._made(False)
        return [fn.forward, fn.backward, *fn.chunked_blocks.values()]

    def __call__(
        self,
        inputs: dict[str, Any] | None = None,
        /,
        *,
        dims: dict[str, int] | None = None,
        grad_scales: DelayedScaling | None = None,
        **tensors: Any,
    ) -> dict[str, torch.Tensor]:
        given = {**(inputs or {}), **tensors}
        device = next((v.device for v in given.values() if isinstance(v, torch.Tensor)), None)
        if device is None:
            raise ValueError(f"block {self.name}: no torch tensor among the inputs")
        return self._fn(not uses_kernels(device))(
            given, dims=dims, grad_scales=grad_scales if grad_scales is not None else self.grad_scales
        )

    def forward_backward(
        self,
        inputs: dict[str, Any] | None = None,
        /,
        *,
        cotangents: dict[str, Any],
        chunk: int,
        dims: dict[str, int] | None = None,
        rounded: bool = True,
        **tensors: Any,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(outputs, gradients by input name): the forward and at once the backward with `cotangents`
        (by output name, tensors of the outputs' shapes), `chunk` rows at a time, each chunk's backward right
        after its forward, so what the forward saves lives for one chunk only (a loss head's logits
        with `remat="save"`: three GEMMs, no [M, V] tensor, as a hand-written fused linear
        cross-entropy does; docs/design.md, "Chunked backward"). Made with `chunk_dim=` the
        forward's row dim. No autograd graph is recorded: wrap it in a torch.autograd.Function whose
        backward scales the gradients (coda_lang.hf's loss head does). Gradients summed over the rows
        (a weight's) add up in f32 and are rounded to their dtype at the end; `rounded=False` returns
        them in f32, so that such a backward scales and rounds them in one pass."""
        given = {**(inputs or {}), **tensors}
        device = next((v.device for v in given.values() if isinstance(v, torch.Tensor)), None)
        if device is None:
            raise ValueError(f"block {self.name}: no torch tensor among the inputs")
        return self._fn(not uses_kernels(device)).forward_backward(given, cotangents, chunk, dims, rounded)


def function(
    block: Block | str,
    *,
    name: str | None = None,
    wrt: list[str] | None = None,
    backward: BackwardOptions | None = None,
    remat: str | None = None,
    tile: Any = None,
    dims: dict[str, int] | None = None,
    chunk: int | str | None = None,
    budget: int | None = None,
    chunk_dim: str | None = None,
    grad_scales: DelayedScaling | None = None,
) -> BlockFunction:
    """`block` (a Block, or .coda source text or a path; `name` picks one of several blocks) as a
    differentiable torch function. The backward's options: one `BackwardOptions` (`backward=`) or its
    fields as keywords (`remat=`, `chunk=`, `budget=`, `chunk_dim=`). `grad_scales`: the
    `DelayedScaling` of a backward with fp8 cotangents. See `BlockFunction`."""
    return BlockFunction(
        _as_block(block, name),
        wrt=wrt,
        backward=backward,
        remat=remat,
        tile=tile,
        dims=dims,
        chunk=chunk,
        budget=budget,
        chunk_dim=chunk_dim,
        grad_scales=grad_scales,
    )


def compile_together(*functions: BlockFunction) -> None:
    """Compile these functions' kernels together, at the first call of any of them on the GPU: one
    parallel compile of every kernel (forward and backward) of all, instead of one per function as each
    is first called (a model's blocks: the first layer's, the layers', the loss head's). Nothing
    changes on the CPU, where the kernels are emulated."""
    group: list[BlockFunction] = []
    for f in functions:
        if not isinstance(f, BlockFunction):
            raise TypeError(f"compile_together takes coda functions, got {type(f).__name__}")
        for g in f._together:
            if g not in group:
                group.append(g)
    for g in group:
        g._together = group


def precompile(*functions: BlockFunction, jobs: int | None = None, quiet: bool = False) -> None:
    """Compile every kernel of these functions now, in `jobs` worker processes (default: one per CPU),
    as their first calls would (the tuning at each shape still happens at the first call there; `coda
    tune` does both ahead of a run). Raises BackendUnavailable without the GPU toolchain."""

    blocks = [b for f in functions for b in f.kernel_blocks()]
    compile_blocks(blocks, jobs=jobs, quiet=quiet, strict=True)


def wait_for_kernels(timeout: float | None = None) -> bool:
    """Block until the kernels that first calls left compiling in the background (each stage's other
    candidate tiles, for the tuner) are all compiled; each stage is then timed at its next launch and
    runs at the fastest tile from there on. True when done, False when `timeout` seconds passed first.
    For a benchmark's steady state, or with `$CODA_TUNE=wait` instead: a first call then compiles and
    times everything before it returns."""
    if "coda_lang.backend_cute.build.parallel" not in sys.modules:  # nothing was ever compiled here
        return True
    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.backend_cute.build.parallel import (
        wait_all,
    )

    return wait_all(timeout)


class BlockModule(torch.nn.Module):
    """A `torch.nn.Module` running one block, owning some of its inputs as parameters.

    `params`: {input name: initial tensor}; each becomes an `nn.Parameter` of that name. `forward(**x)`
    takes the block's other inputs and returns its outputs by name (a dict), or the only output.
    `grad_scales`: the `DelayedScaling` of a backward with fp8 cotangents (one per module).
    """

    def __init__(
        self,
        block: Block | str,
        params: dict[str, torch.Tensor],
        *,
        name: str | None = None,
        backward: BackwardOptions | None = None,
        remat: str | None = None,
        tile: Any = None,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
        grad_scales: DelayedScaling | None = None,
    ):
        super().__init__()
        self.fn = function(
            block,
            name=name,
            backward=backward,
            remat=remat,
            tile=tile,
            chunk=chunk,
            budget=budget,
            chunk_dim=chunk_dim,
            grad_scales=grad_scales,
        )
        names = {p.var.name for p in self.fn.block.ir.params}
        for k, v in params.items():
            if k not in names:
                raise ValueError(
                    f"block {self.fn.name} has no input `{k}`; inputs: {', '.join(sorted(names))}"
                )
            self.register_parameter(k, torch.nn.Parameter(v))

    def forward(self, *args: Any, **inputs: Any) -> Any:
        if args:
            raise TypeError(f"{type(self).__name__} takes its inputs by name")
        params = dict(self.named_parameters(recurse=False))
        outs = self.fn({**inputs, **params})
        return next(iter(outs.values())) if len(outs) == 1 else outs


# The LLaMA MLP's three GEMM stages: out-proj + residual + RMSNorm's statistics, gate/up + SwiGLU (the
# norm's row scale deferred into its epilogue), down + residual. The one source of `LlamaMLP`'s block,
# of coda_lang.hf's layer blocks (hf/blocks.py) and of examples/llama_mlp.coda (tests/test_torch_api.py
# checks the example against `llama_mlp_source(linear=False, attn="D")`).
_LLAMA_MLP_STAGES = """
  gemm y @ {w_o} {{
    {h}: {t} = acc{residual} + x
    {h}g: {t} = {h} * {g}
    ss{n} = sum({h} * {h}, over=D)
  }}
  r{n} = rsqrt(ss{n} / D + eps)
  gemm {h}g @ {w_13} {{
    z{n} = acc * r{n}
    gt, up = pairs(z{n})
    a: {t} = {act}(gt) * up
  }}
  gemm a @ {w_2} {{
    {x2} = acc{residual} + {h}{then}
  }}"""

# The same stages with the gate/up and down GEMMs in e4m3 at delayed per-tensor scales (fp8="delayed"):
# the out-projection's epilogue quantizes the norm's weighted input `{h}q` with the scale `s_{h}` (an
# input, last steps' amax) and records this step's amax (`am_{h}`, detached: no gradient); the gate/up
# GEMM multiplies it by the e4m3 weight `w_13q` (made by `fp8_weight`) and folds both inverse scales
# into the norm's row scale; its SwiGLU output is quantized the same way (`aq`, or stored in {t} and
# multiplied by the {t} down weight where `act_fp8` is off). The out-projection's stage is
# remat="rebuild": its e4m3 `{h}q`, which the gate/up weight gradient reads, is made again from the
# saved `{h}` by an elementwise pass at the backward's start (bit for bit: it quantizes the stored
# value, `cast({h}, {t})`), not saved (D bytes a row) and not stored again by the gate/up data
# gradient's epilogue (what "auto" would do), whose fp8 store there narrowed its tiles (1.19 ms
# against the bf16 block's 0.89 ms a call, Llama-3.2-1B shapes, H100).
_LLAMA_MLP_STAGES_FP8 = """
  gemm {y} @ {w_o}, remat="rebuild" {{
    {h}: {t} = acc{o_scale}{residual} + x
    {h}g = cast({h}, {t}) * {g}
    {h}q: e4m3 = {h}g * s_{h}
    amp_{h} = max(abs({h}g), over=D)
    ss{n} = sum({h} * {h}, over=D)
  }}
  am_{h} = detach(max(amp_{h}, over=M))
  r{n} = rsqrt(ss{n} / D + eps)
  i{n} = r{n} / (s_{h} * s_w_13){u_before}
  gemm {h}q @ {w_13} {{
    z{n} = acc * i{n}{u_line}
    gt, up = pairs(z{n})
    {a_line}
  }}{u_after}{a_after}
  gemm {a} @ {w_2} {{
    {x2} = acc{down_scale}{residual} + {h}{then}
  }}"""

_LLAMA_MLP_BLOCK = """dims M, D, F{k_dim}

block llama_mlp(y: {t}[M, {k}], x: {t}[M, D], w_o: {t}[{w_o}], g: f32[D], w_13: {t}[{w_13}],
                w_2: {t}[{w_2}], eps: f32 = {eps}) -> (x2: {t}[M, D]) {{{stages}
}}
"""


def llama_mlp_stages(
    t: str,
    *,
    linear: bool = True,
    h: str = "h",
    n: str = "",
    stored: bool = False,
    then: str = "",
    residual: str = "",
    act: str = "silu",
    norm_offset: float = 0.0,
) -> str:
    """The LLaMA MLP's stages as .coda text (each line indented for a block's body), at storage dtype
    `t` ("bf16", "f16", "f32"). `linear`: weights in `nn.Linear` layout ([out, in], read as
    `transpose(w)`), else [in, out]. `h`: the residual's name (the norm's input `{h}g`); `n`: the suffix
    of the norm's names (`g{n}`, `ss{n}`, `r{n}`, `z{n}`); `stored`: `x2` stored as `t` within its
    stage (for `then`, statements that follow it in the down-projection's epilogue); `residual`: a
    factor of each branch before it joins the residual (" * rm": `acc * rm + x`, Granite's); `act`: the
    gate's activation, a .coda op of one argument (`silu`: SwiGLU; `gelu`, tanh-approximated: GeGLU);
    `norm_offset`: the norm scales by (norm_offset + g) (Gemma's 1 + w) when not 0."""
    w = (lambda name: f"transpose({name})") if linear else (lambda name: name)
    return _LLAMA_MLP_STAGES.format(
        t=t,
        w_o=w("w_o"),
        w_13=w("w_13"),
        w_2=w("w_2"),
        h=h,
        n=n,
        x2=f"x2: {t}" if stored else "x2",
        then=then,
        residual=residual,
        g=norm_weight(f"g{n}", norm_offset),
        act=act,
    )


def norm_weight(name: str, offset: float) -> str:
    """A norm weight as the stages read it: `name`, or (offset + name) (Gemma's 1 + w)."""
    return f"({float(offset)!r} + {name})" if offset else name


def fp8_weight(name: str, rows: str, cols: str) -> str:
    """An elementwise stage (.coda text) quantizing the weight `name` ([rows, cols]) to e4m3 at its delayed
    scale `s_{name}` (an input), as `{name}q`, and recording its amax `am_{name}` (detached)."""
    return (
        f"\n  elementwise [{rows}, {cols}] {{\n    {name}q: e4m3 = {name} * s_{name}"
        f"\n    amp_{name} = max(abs({name}), over={cols})\n  }}"
        f"\n  am_{name} = detach(max(amp_{name}, over={rows}))"
    )


def fp8_out_projection() -> str:
    """The stages (.coda text) that quantize the out-projection's operands to e4m3 at their delayed
    scales: the weight (`fp8_weight`: `w_oq`, `am_w_o`) and the attention output `y` ([M, K], made by
    the attention, outside the blocks: a pass of its own), as `yq` with its amax `am_y`; `io` their
    inverse scales, which the out-projection's epilogue folds."""
    return fp8_weight("w_o", "D", "K") + (
        "\n  elementwise [M, K] {\n    yq: e4m3 = y * s_y\n    amp_y = max(abs(y), over=K)\n  }"
        "\n  am_y = detach(max(amp_y, over=M))\n  io = 1.0 / (s_y * s_w_o)"
    )


def acc_copy_lines(n: str) -> tuple[str, str, str]:
    """A gate/up stage's e4m3 copy of its acc, `u{n}q`, for a backward derived with
    `BackwardOptions(fp8_acc=True)` to read as that acc (docs/design.md, "Saving activations in fp8"):
    (the line before the stage, the stage's lines, the line after it). The copy is of z{n} = acc * i{n}
    (the pre-activations, each row normalized, independent of the GEMM's fp8 scales) at the delayed
    scale `s_u{n}`, written `acc * c{n}` with c{n} = i{n} * s_u{n} per row; its amax `am_u{n}` (of
    z{n}, detached)."""
    return (
        f"\n  c{n} = i{n} * s_u{n}",
        f"\n    u{n}q: e4m3 = acc * c{n}\n    amp_u{n} = max(abs(z{n}), over=2*F)",
        f"\n  am_u{n} = detach(max(amp_u{n}, over=M))",
    )


def llama_mlp_stages_fp8(
    t: str,
    *,
    h: str = "h",
    n: str = "",
    stored: bool = False,
    then: str = "",
    residual: str = "",
    act: str = "silu",
    norm_offset: float = 0.0,
    act_fp8: bool = True,
    save_acc: bool = False,
    out_fp8: bool = False,
) -> str:
    """`llama_mlp_stages` (weights in `nn.Linear` layout) with the gate/up GEMM, and with `act_fp8` the
    down GEMM, in e4m3 at delayed per-tensor scales (fp8="delayed"): reads the e4m3 weights `w_13q`
    (and `w_2q`, `fp8_weight`'s), the scales `s_{h}`, `s_w_13` (and `s_a`, `s_w_2`); records the
    amaxes `am_{h}` (and `am_a`), detached. The scales are inputs: the caller keeps their history
    (coda_lang.hf's fp8 `Bank`). `save_acc`: the gate/up GEMM also stores an e4m3 copy of its acc,
    `u{n}q` (`acc_copy_lines`: its scale `s_u{n}`, its amax `am_u{n}`), for a backward derived with
    `BackwardOptions(fp8_acc=True)` to read instead of a bf16 copy. `out_fp8`: the out-projection in
    e4m3 too, reading `yq` and `w_oq` and folding `io` (`fp8_out_projection`'s, which the caller
    writes before these stages)."""
    g = norm_weight(f"g{n}", norm_offset)
    if act_fp8:
        a_line = f"a = {act}(gt) * up\n    aq: e4m3 = a * s_a\n    amp_a = max(abs(a), over=F)"
        a_after = "\n  am_a = detach(max(amp_a, over=M))\n  ia = 1.0 / (s_a * s_w_2)"
        a, w_2, down_scale = "aq", "transpose(w_2q)", " * ia"
    else:
        a_line = f"a: {t} = {act}(gt) * up"
        a_after, a, w_2, down_scale = "", "a", "transpose(w_2)", ""
    u_before, u_line, u_after = acc_copy_lines(n) if save_acc else ("", "", "")
    return _LLAMA_MLP_STAGES_FP8.format(
        t=t,
        u_before=u_before,
        u_line=u_line,
        u_after=u_after,
        y="yq" if out_fp8 else "y",
        w_o="transpose(w_oq)" if out_fp8 else "transpose(w_o)",
        o_scale=" * io" if out_fp8 else "",
        w_13="transpose(w_13q)",
        w_2=w_2,
        h=h,
        n=n,
        x2=f"x2: {t}" if stored else "x2",
        then=then,
        residual=residual,
        g=g,
        a_line=a_line,
        a_after=a_after,
        a=a,
        down_scale=down_scale,
    )


def llama_mlp_source(t: str = "bf16", eps: float = 1e-6, *, linear: bool = True, attn: str = "K") -> str:
    """The block `llama_mlp(y, x, w_o, g, w_13, w_2, eps) -> (x2)` as a .coda program: `llama_mlp_stages`
    at storage dtype `t`, weights in `nn.Linear` layout (`linear`) or [in, out]; `attn`, the dim of
    the attention output's width (y's columns: "K", or "D" when it is the hidden size)."""
    k = attn
    shapes = {"w_o": (f"D, {k}", f"{k}, D"), "w_13": ("2*F, D", "D, 2*F"), "w_2": ("D, F", "F, D")}
    return _LLAMA_MLP_BLOCK.format(
        t=t,
        eps=repr(float(eps)),
        k=k,
        k_dim="" if k == "D" else f", {k}",
        stages=llama_mlp_stages(t, linear=linear),
        **{name: pair[0 if linear else 1] for name, pair in shapes.items()},
    )


class LlamaMLP(BlockModule):
    """After a LLaMA layer's attention: `x2 = mlp(rmsnorm(y @ w_o.T + x) * g) + (y @ w_o.T + x)`, three
    fused GEMMs. `forward(y, x)`: y the attention output [tokens, heads*head_dim], x the residual
    [tokens, hidden]. Weights are in `nn.Linear` layout ([out, in]); `w_13` holds gate and up rows
    interleaved (g0, u0, g1, u1, ...: `coda_lang.layout.interleave_gate_up` on the transposes). The
    backward's options: `backward=` or its keyword shorthands, as `function` takes them."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        attn_width: int | None = None,
        *,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        backward: BackwardOptions | None = None,
        remat: str | None = None,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
    ):
        t = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}.get(dtype)
        if t is None:
            raise ValueError(f"LlamaMLP: dtype must be bfloat16, float16 or float32, got {dtype}")
        k = hidden if attn_width is None else attn_width
        std = 0.02

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device) * std).to(dtype)

        params = {
            "w_o": w(hidden, k),
            "g": torch.ones(hidden, device=device, dtype=dtype),
            "w_13": w(2 * intermediate, hidden),
            "w_2": w(hidden, intermediate),
        }
        super().__init__(
            llama_mlp_source(t, eps),
            params,
            backward=backward,
            remat=remat,
            chunk=chunk,
            budget=budget,
            chunk_dim=chunk_dim,
        )

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return super().forward(y=y, x=x)
