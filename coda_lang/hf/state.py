"""The state of one patched model: its facts (heads, widths, dtype), its block functions and the
loss head's settings, and the small tensors its forward makes once.

What it does: `ModelState(model, family, loss)` holds the model's facts; `blocks(dtype)` builds the
model's program (blocks.py) for its shapes at one dtype and makes each block a differentiable torch
function (`coda_lang.torch.function`; `Blocks`): the first layer's, the layers', the last layer's,
the logits head and, made when first used, the loss head of each loss mode; their kernels compile
together at the first call. With fp8="delayed" the layers' three are made with
`BackwardOptions(fp8_grads="e5m2")` (blocks.FP8_GRADS), each call passing its call site's cotangent
scales (fp8.py); the state they are made with, `fp8.NoCallSite`, serves no backward. The blocks of the dtype at patching are made at once (`first`, `layer`,
`last`, `head_logits`, `row_head()`, `vocab_head()`), those of another dtype (the param_dtype of
FSDP2's MixedPrecisionPolicy, a model cast after patching) when it first runs. `positions` and
`freqs` give the default positions and each layer's RoPE frequencies (Gemma 3's per kind of layer),
made once per shape (and per `inv_freq` version).
What it does not: touch the model's modules (patch.py), run the forward (forward.py) or the loss
(loss.py).
Invariants: made once per model, at patching; the model and each decoder layer keep it as `_coda`
(private: the loss settings are `apply_coda_to_*`'s arguments), with the forward's contract
(`contract`, contract.py). A copy or pickle of the model makes its state again from the facts
(`__reduce__`): blocks of its own, the layout and the contract copied with the model's modules.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from coda_lang.api import Program, load
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.plan.spec import fp8_pair_load_on, pair_store_on
from coda_lang.hf.blocks import DELAYED, FP8_GRADS, FP8_OUT_VAR, FP8_SAVE_VAR, family_source
from coda_lang.hf.checkpoint import Layout
from coda_lang.hf.family import Family, multipliers, softcap
from coda_lang.hf.fp8 import Bank, NoCallSite
from coda_lang.hf.loss import LOSS_CHUNK_BYTES, LossSettings
from coda_lang.hf.masks import layer_kinds
from coda_lang.hf.split import split
from coda_lang.torch import BlockFunction, compile_together, function

# the dtype of loss_mode="fp8"'s dlogits (its backward's cotangent): e5m2 by default, as the layers';
# $CODA_FP8_HEAD_GRADS=e4m3 (one more mantissa bit: dlogits are bounded, they need no e5m2 range)
FP8_HEAD_GRADS_VAR = "CODA_FP8_HEAD_GRADS"


def fp8_head_grads() -> str:
    """The fp8 dtype loss_mode="fp8"'s head quantizes its dlogits to ($CODA_FP8_HEAD_GRADS, read when a
    model is patched; ValueError for a value other than e5m2 or e4m3)."""
    got = os.environ.get(FP8_HEAD_GRADS_VAR, "e5m2")
    if got not in ("e5m2", "e4m3"):
        raise ValueError(f"${FP8_HEAD_GRADS_VAR} is {got!r}; it takes e5m2 (the default) or e4m3")
    return got


def fp8_save(fp8: str | None) -> bool:
    """Whether a model patched now with fp8 recipe `fp8` saves its gate/up accumulators in e4m3
    (blocks.model_source's `fp8_save`): with fp8 cotangents ("delayed"), unless $CODA_FP8_SAVE_ACC=0,
    and where the kernels store the SwiGLU backward's e5m2 cotangent as pairs and load an fp8 tile
    beside it (not under $CODA_FP8_PAIR_STORE=0 or $CODA_FP8_PAIR_LOAD=0, which would refuse that
    stage). Read when the model is patched."""
    if fp8 not in DELAYED or FP8_GRADS[fp8] is None or os.environ.get(FP8_SAVE_VAR, "1") == "0":
        return False
    return pair_store_on() and fp8_pair_load_on()


def fp8_out(fp8: str | None) -> bool:
    """Whether a model patched now with fp8 recipe `fp8` runs its layers' out-projection in e4m3 too
    (blocks.model_source's `fp8_out`): with a delayed recipe unless $CODA_FP8_OUT=0 (on by default since
    its convergence run; any other value than 0 or 1 is a ValueError, and so is an explicit 1 with another
    fp8 recipe, which would not honour it; unset, another recipe keeps the out-projection in the model's
    dtype). Read when the model is patched."""
    got = os.environ.get(FP8_OUT_VAR)
    if got is not None and got not in ("0", "1"):
        raise ValueError(
            f"${FP8_OUT_VAR} is {got!r}; it takes 1 (the default with fp8='delayed': the out-projection in "
            "e4m3) or 0 (the out-projection in the model's dtype)"
        )
    if got == "1" and fp8 is not None and fp8 not in DELAYED:
        raise ValueError(
            f"${FP8_OUT_VAR}=1 runs the out-projection in e4m3 with fp8='delayed' or 'delayed-forward'; "
            f"fp8={fp8!r} keeps it in the model's dtype: unset {FP8_OUT_VAR} to patch with {fp8!r}"
        )
    return got != "0" and fp8 in DELAYED


@functools.lru_cache(maxsize=16)
def program(text: str) -> Program:
    """The checked program of a model's source text, made once per process for each text: every model
    patched alike (another instance, a deep copy, the blocks of another dtype made again, a model
    patched after `unpatch`) shares it, and with it each block's derivations (`Block.derivation`
    keeps them), which are most of the time a patch takes. A program is not changed after `load`."""
    return load(text)


# what a patched model's blocks differentiate: the weights of `blocks.model_source`'s programs, and the
# activations a block takes from the one before it (never the fp8 scales, the positions or the targets)
WEIGHTS = frozenset(
    {"w_o", "w_13", "w_2", "w_qkv", "b_qkv", "w_lm", "g", "g1", "g2", "go", "gd", "gq", "gk", "gqk"}
)
ACTIVATIONS = ("h", "y", "x", "hg", "r")


def block_wrt(block: Any) -> list[str]:
    """The parameters of a block of `blocks.model_source`'s program that its block function
    differentiates (`WEIGHTS`, `ACTIVATIONS`), in the block's order."""
    return [p.var.name for p in block.ir.params if p.var.name in WEIGHTS or p.var.name in ACTIVATIONS]


class Blocks:
    """A patched model's block functions at one dtype (its parameters', or under FSDP2's
    MixedPrecisionPolicy the gathered parameters' `param_dtype`): the first layer's, the layers', the
    last layer's, the logits head and, made when first used, the loss head of each loss mode."""

    def __init__(self, st: ModelState, dtype: torch.dtype, eps: float):
        self.dtype = dtype
        f = st.family

        def source(head_rows: bool = False) -> str:
            return family_source(
                f,
                str(dtype).removeprefix("torch."),
                eps,
                st.HD,
                (st.H, st.KV),
                st.multipliers,
                st.softcap,
                head_rows=head_rows,
                fp8=st.fp8,
                fp8_save=st.fp8_save,
                fp8_head=st.loss_mode == "fp8",
                fp8_out=st.fp8_out,
            )

        prog = program(source())
        self._source = source

        def fn(name: str, backward: BackwardOptions | None = None) -> BlockFunction:
            b = prog[name]
            wrt = block_wrt(b)
            # (fp8 cotangents: each call passes its call site's grad state, fp8.run_scaled)
            state = NoCallSite(name) if backward is not None and backward.fp8_grads else None
            # the model's widths among the block's dims, bound: each call's shapes are checked against
            # them, and the backward's default epilogue cuts are decided by them (split_epilogue.long_fp8)
            declared = {d.name for d in b.ir.dims}
            widths = {k: v for k, v in (("D", st.D), ("F", st.F)) if k in declared and v is not None}
            return function(b, wrt=wrt, backward=backward, grad_scales=state, dims=widths or None)

        # the default saved-tensor policy (auto): e.g. the SwiGLU output is recomputed in the backward.
        # fp8="delayed": the cotangents of the e4m3 GEMMs' accumulators quantized to e5m2 (blocks.py,
        # FP8_GRADS), at each call site's delayed scales (fp8.py, `Bank.grads`); fp8="blockwise": the
        # same, and each weight gradient reads its activation quantized again in 128 x 1 groups
        cot = FP8_GRADS[st.fp8] if st.fp8 else None
        requant = st.fp8 == "blockwise"
        layers = (
            BackwardOptions(fp8_grads=cot, fp8_acc=st.fp8_save, requantize_wgrad=requant) if cot else None
        )
        self.first, self.layer, self.last = fn("first_qkv", layers), fn("layer", layers), fn("last", layers)
        # the loss head. "vocab": it keeps only its log-sum-exp, its backward runs the GEMM again in
        # chunks of the vocabulary (each chunk's weight gradient complete): four GEMMs. "rows": chunks
        # of rows, each chunk's forward keeping its logits and its backward run at once in the
        # forward: three GEMMs, the weight gradient summed over the chunks inside its GEMM
        self.head_logits = fn("head_logits")
        self.loss_budget = st.loss_budget
        self._fp8 = st.fp8
        self._fn = fn
        self._prog = prog
        self.head_norm = f.qk_norm in ("head", True)
        self._parts: dict[
            tuple[str, tuple[str, ...], tuple[str, ...]], list[tuple[BlockFunction, tuple[str, str] | None]]
        ] = {}
        self._vocab_head: BlockFunction | None = None
        self._row_head: BlockFunction | None = None
        self._fp8_head: BlockFunction | None = None
        # a training step's kernels (the first layer's, the layers', the last layer's, the loss head's:
        # forward and backward) compile at once at its first call, in one pool of workers
        compile_together(self.first, self.layer, self.last, self.loss_head(st.loss_mode))

    def named(self, name: str) -> BlockFunction:
        """The layers' block function of that name: "first_qkv", "layer" or "last"."""
        return {"first_qkv": self.first, "layer": self.layer, "last": self.last}[name]

    def parts(
        self, name: str, cut: tuple[str, ...], frozen: tuple[str, ...] = ()
    ) -> list[tuple[BlockFunction, tuple[str, str] | None]]:
        """Block `name` cut before the GEMMs on the weights `cut` (split.py: where peft LoRA adapters
        add to a GEMM's accumulator, lora.py), each part a function with its cut GEMM's operands in
        the block (x, w) or None; the parameters in `frozen` not differentiated (no weight-gradient
        GEMM for a frozen base). Made at first use, its kernels compiled at its first call."""
        key = (name, cut, frozen)
        got = self._parts.get(key)
        if got is None:
            prog = self._prog
            if "w_qkv" in cut and self.head_norm:
                # (a per-head q/k norm after a GEMM that adds LoRA's output: in a row stage)
                prog = program(self._source(head_rows=True))  # (made once per process)
            block = prog[name]
            own = {p.var.name for p in block.ir.params}
            wants = (WEIGHTS | set(ACTIVATIONS)) - set(frozen)
            pieces = split(block, prog.ir.dims, cut) if cut else [(block, None)]
            got = []
            for b, ops in pieces:
                # differentiated: what the block is, and what the parts before make (and lora_c)
                wrt = [p.var.name for p in b.ir.params if p.var.name in wants or p.var.name not in own]
                got.append((function(b, wrt=wrt), ops))
            compile_together(*[fn for fn, _ in got])  # (the parts' kernels in one pool, at their first call)
            self._parts[key] = got
        return got

    def loss_head(self, mode: str) -> BlockFunction:
        """The loss head of loss mode `mode` (hf/loss.py's LOSS_MODES)."""
        return {"rows": self.row_head, "vocab": self.vocab_head, "fp8": self.fp8_head}[mode]()

    def row_head(self) -> BlockFunction:
        """The loss head of "rows" mode: its logits saved (remat="save"), run forward and backward
        in chunks of rows (BlockFunction.forward_backward); `head_loss_rows`, whose forward makes the
        loss from the same rounded logits its backward reads."""
        if self._row_head is None:
            self._row_head = self._fn("head_loss_rows", BackwardOptions(remat="save", chunk_dim="M"))
        return self._row_head

    def vocab_head(self) -> BlockFunction:
        """The loss head whose backward runs in chunks of V within `loss_budget` bytes."""
        if self._vocab_head is None:
            options = BackwardOptions(chunk="auto", budget=self.loss_budget, chunk_dim="V")
            self._vocab_head = self._fn("head_loss", options)
        return self._vocab_head

    def fp8_head(self) -> BlockFunction:
        """The loss head of loss_mode="fp8": `head_loss_fp8`, its GEMMs in fp8, its backward derived
        with e5m2 cotangents (each call passes its call site's grad state, fp8.run_scaled), run whole."""
        if self._fp8_head is None:
            if self._fp8 not in DELAYED or not FP8_GRADS[self._fp8]:
                raise ValueError("loss_mode='fp8' needs a model patched with fp8='delayed'")
            self._fp8_head = self._fn("head_loss_fp8", BackwardOptions(fp8_grads=fp8_head_grads()))
        return self._fp8_head


class ModelState:
    """The facts of one patched model and its block functions."""

    layout: Layout  # where each weight sits, patched and Hugging Face's: set by the patch (checkpoint.py)

    def __init__(self, model: Any, family: Family, loss: LossSettings, fp8: str | None = None):
        cfg = model.config
        heads = cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        facts: tuple[Any, ...] = (heads, cfg.num_key_value_heads, hd, cfg.hidden_size, cfg.rms_norm_eps)
        facts += (
            model.dtype,
            multipliers(family, cfg),
            softcap(family, cfg),
            tuple(layer_kinds(family, cfg)),
            fp8,
            fp8_save(fp8),
            fp8_out(fp8),
            # the MLP's width, where the config has one for every layer (the block functions' dim F:
            # split_epilogue's default cut reads it)
            cfg.intermediate_size if isinstance(getattr(cfg, "intermediate_size", None), int) else None,
        )
        self._build(family, loss, facts)
        # what the forward relies on, recorded by the patch once it has installed its forwards
        self.contract: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy (`copy.deepcopy`, pickle) is made from the facts, with blocks of its own and a copy
        of the layout and the contract (its modules those of the model copied with it, one memo)."""
        return (_restored, (self.family, self.loss, self.facts, self.layout, self.contract))

    def _build(self, family: Family, loss: LossSettings, facts: tuple[Any, ...]) -> None:
        self.facts = facts
        self.family = family
        self.qk_norm = family.qk_norm
        (
            self.H,
            self.KV,
            self.HD,
            self.D,
            self.eps,
            dtype,
            self.multipliers,
            self.softcap,
            kinds,
            fp8,
            save,
            out,
            self.F,
        ) = facts
        self.fp8: str | None = fp8  # the fp8 recipe of the blocks (blocks.FP8_RECIPES), or None: bf16
        self.fp8_save: bool = save  # the gate/up GEMMs' acc saved in e4m3 (blocks.model_source's fp8_save)
        self.fp8_out: bool = out  # the out-projection in e4m3 too (blocks.model_source's fp8_out)
        # its delayed scales, and those of its e5m2 cotangents with "delayed" (fp8.py)
        self.fp8_bank: Bank | None = Bank(FP8_GRADS[fp8]) if fp8 else None
        self.kinds: tuple[str, ...] = kinds  # each decoder layer's kind of attention (masks.py)
        self.dtype = dtype  # the dtype at patching; the blocks of another are made when it runs
        self.loss = loss
        self.loss_mode = loss.mode
        # bytes of the largest transient of a chunk ("vocab")
        self.loss_budget = LOSS_CHUNK_BYTES if loss.budget is None else loss.budget
        self.loss_rows = loss.rows or 0  # rows per chunk of the loss head ("rows"); 0: from LOSS_ROWS_BYTES
        # made once, not at each forward (launches while the GPU waits at a step's start): the default
        # positions of the last (batch, seq, device), and the RoPE frequencies of the model's inv_freq
        # buffer while it is the same tensor at the same version (not modified in place)
        self._positions: tuple[tuple[int, int, str], torch.Tensor] | None = None
        self._freq: tuple[tuple[Any, ...], str, tuple[torch.Tensor, ...]] | None = None
        self._blocks: dict[torch.dtype, Blocks] = {}
        main = self.blocks(self.dtype)  # (made now: a block that can't be made fails the patch)
        self.first, self.layer, self.last, self.head_logits = (
            main.first,
            main.layer,
            main.last,
            main.head_logits,
        )

    def blocks(self, dtype: torch.dtype) -> Blocks:
        """The block functions at `dtype` (made at its first use: a model whose layers run in another
        dtype than at patching, as under FSDP2's MixedPrecisionPolicy, compiles its kernels then)."""
        got = self._blocks.get(dtype)
        if got is None:
            got = self._blocks[dtype] = Blocks(self, dtype, self.eps)
        return got

    def row_head(self) -> BlockFunction:
        """The "rows" loss head at the dtype of patching."""
        return self.blocks(self.dtype).row_head()

    def vocab_head(self) -> BlockFunction:
        """The "vocab" loss head at the dtype of patching."""
        return self.blocks(self.dtype).vocab_head()

    @property
    def rope_width(self) -> int:
        return (self.H + self.KV) * self.HD

    def positions(self, b: int, s: int, device: torch.device) -> torch.Tensor:
        """The f32 positions 0..s-1 of each of b sequences, flattened: the default position_ids."""
        key = (b, s, str(device))
        if self._positions is None or self._positions[0] != key:  # a new shape replaces the last
            self._positions = (key, torch.arange(s, device=device, dtype=torch.float32).repeat(b))
        return self._positions[1]

    def freq(self, model: Any, device: torch.device) -> torch.Tensor:
        """RoPE's frequency of each column of the fused QKV tile's q and k heads (0 for v's), of the
        first layer (`freqs`)."""
        return self.freqs(model, device)[0]

    def freqs(self, model: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Each decoder layer's RoPE frequency of each column of its fused QKV tile's q and k heads (0
        for v's): from the rotary embedding's `inv_freq`, or (Gemma 3: `Family.rope_kinds`) from its
        `<kind>_inv_freq` of the layer's kind. Made again when an `inv_freq` is another tensor or was
        modified in place; the layers of one kind share one tensor."""
        rope = model.model.rotary_emb
        if self.family.rope_kinds:
            invs = {k: getattr(rope, f"{k}_inv_freq") for k in dict.fromkeys(self.kinds)}
        else:
            invs = {k: rope.inv_freq for k in dict.fromkeys(self.kinds)}
        key = tuple((inv, inv._version) for inv in invs.values())
        got = self._freq
        if (
            got is not None
            and got[1] == str(device)
            and len(got[0]) == len(key)
            and all(a is b and v == w for (a, v), (b, w) in zip(got[0], key, strict=True))
        ):
            return got[2]
        tables = {}
        for kind, inv in invs.items():
            inv32 = inv.to(device=device, dtype=torch.float32)
            tables[kind] = torch.cat(
                [inv32.repeat(self.H + self.KV), inv32.new_zeros(self.KV * self.HD // 2)]
            )
        out = tuple(tables[k] for k in self.kinds)
        self._freq = (key, str(device), out)
        return out


def _restored(
    family: Family, loss: LossSettings, facts: tuple[Any, ...], layout: Layout, contract: Any
) -> ModelState:
    """A model state made again from its facts (`ModelState.__reduce__`)."""
    st = ModelState.__new__(ModelState)
    st._build(family, loss, facts)
    st.layout, st.contract = layout, contract
    return st
