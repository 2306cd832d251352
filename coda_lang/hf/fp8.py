"""fp8 training of a patched model (`apply_coda(model, fp8="delayed")`, "delayed-forward" or
"blockwise"): the delayed per-tensor scales of each block's e4m3 inputs and weights, and ("delayed",
"blockwise") of its e5m2 cotangents, kept across steps. A "blockwise" block computes its forward's
scales itself (current 1 x 128 and 128 x 128 amaxes): its call site keeps only its cotangents' grad
state, and it runs on whole groups of 128 tokens (`whole_row_groups`).

What it does: `run_scaled(bank, owner, step, index, run, fn, inputs, loras)` runs block `fn` (blocks.py's
fp8 variant: its gate/up, down and QKV GEMMs in e4m3) with this step's scales of its call site (`index`:
-1 the model's first block, i the block of decoder layer i, HEAD_SITE (-2) the loss head of
loss_mode="fp8"; every family's: blocks.py writes the
post-norm and sandwich layers' fp8 blocks too) and keeps the amaxes it returns in the `Step`;
`record(bank, step)`, at the end of the forward, sets every call site's next scales at once. The
`Bank` (one per patched model, `ModelState.fp8_bank`) holds all call sites' scales in one vector and
their past amaxes in one ring tensor, so that a step's scale updates are a few kernels, not a few per
layer (the fp8 forward is short enough that the host's launches would show). The rule, per scale:
scale = 448 / max(the amaxes of the last `HISTORY` steps), kept as it was where that max is 0 or not
finite (`delayed_scales`, which backend_cute/runtime/grad_scales.py's DelayedScaling applies too).
A call site's first call calibrates: it runs the block once without autograd at scales 1 and sets its
scales from that run's amaxes (current scaling for the first step), so that no step runs at a default scale. A forward run
again by activation checkpointing (the same decoder layer in the same `Step`) runs at the scales its
first run used and records nothing, so the recomputed tensors are the ones the first run saved.
The backward ("delayed": the block functions made with `BackwardOptions(fp8_grads="e5m2")`, state.py):
each call site has its own `DelayedScaling(initial="calibrate", history=HISTORY)` (`Bank.grads`,
made with the site), the scales of the e5m2 cotangents of its GEMMs' accumulators (`dacc<k>_scale`),
passed as `grad_scales=` to every run of the site's block that autograd may differentiate (the
checkpointing's second run included: under reentrant checkpointing its graph is the one whose
backward runs); each backward runs at the state's scales and records the amaxes that set the next
step's (57344 / max of the last HISTORY amaxes), its first one calibrating. "delayed-forward" has no
grad states: its cotangents stay in the model's dtype.
Across data-parallel ranks: by default each rank keeps its own scales (its activations' amaxes; the
weights', the same on every rank, agree). `reduce_amaxes(model, group)` (`coda_lang.hf.
reduce_fp8_amaxes`) makes every forward of the model reduce its amaxes (the max) over `group` before
it sets the next scales, each call site's calibration too, and ("delayed") each call site's backward
its cotangents' amaxes, so that every rank quantizes at the scales one process on the whole batch
would: one all-reduce of one small vector a forward, and one a layer's backward. Every rank must then
run every forward and backward of the model (each is a collective).
Checkpoints: `model.state_dict()` keeps Hugging Face's names and nothing of fp8, so a model loaded
from it calibrates again at its first step; `state_dict(model)` (`coda_lang.hf.fp8_state_dict`) is
the scales, their history and the cotangents' grad states, and `load_state_dict(model, state)`
(`coda_lang.hf.load_fp8_state_dict`) resumes them: the next step runs at the scales the saved
model's would have.
What it does not: quantize anything itself (the blocks do).
Invariants: scales and amaxes are f32 tensors on the device of the blocks' inputs, and nothing here
waits for the GPU; peft LoRA adapters on an fp8 block are refused (ValueError), never skipped; a
block function with fp8 cotangents never runs a backward without its call site's grad state
(`NoCallSite` raises).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from coda_lang.backend_cute.runtime.capture import refuse_in_capture
from coda_lang.backend_cute.runtime.grad_scales import (
    AmaxRing,
    DelayedScaling,
    delayed_scales,
    f32_row,
    update_scales,
)
from coda_lang.hf.blocks import FP8_OUT_SCALES, FP8_OUT_VAR, FP8_SAVE_SCALE, FP8_SAVE_VAR, SCALE_GROUP
from coda_lang.hf.checks import peft_inner, refuse
from coda_lang.ir.types import FP8_MAX

# amaxes a scale is computed from (torchao's delayed scaling kept 16 by default)
HISTORY = 16
# the call site of the loss head of loss_mode="fp8" (the first block's is -1, decoder layer i's is i)
HEAD_SITE = -2
E4M3_MAX = FP8_MAX["e4m3"]


def scale_names(block: Any) -> list[str]:
    """The quantized values of a block, by its scale inputs `s_<name>`."""
    return [p.var.name[2:] for p in block.ir.params if p.var.name.startswith("s_")]


class NoCallSite(DelayedScaling):
    """The grad state a patched model's block function with fp8 cotangents is made with
    (coda_lang.torch requires one): one function serves every call site of its block, each of which
    passes its own (`Bank.grads`, `run_scaled`), so a backward that reaches this state was run
    without its call site's and raises, rather than share scales between layers."""

    def __init__(self, block: str):
        super().__init__("calibrate")
        self.block = block

    def scales_for(self, device: torch.device) -> dict[str, torch.Tensor]:
        raise RuntimeError(
            f"coda_lang.hf: the backward of block {self.block} (fp8 cotangents) ran without its call "
            "site's delayed scales; a patched fp8 model's blocks are run by its forward, which passes "
            "each call site's DelayedScaling (coda_lang/hf/fp8.py, run_scaled): call the model or its "
            "decoder layers, not the block functions"
        )


class Bank:
    """The delayed scales of every call site of one patched model: `scales` one f32 vector (each call
    site a slice of it, `sites[index] = (start, names)`), `past` the last HISTORY - 1 steps' amaxes (a
    ring of rows, 0 where none was recorded yet: an amax is >= 0, so a 0 changes no max), `steps` the
    forwards recorded. `cotangents`: the fp8 dtype the blocks' backward quantizes its cotangents to
    (blocks.FP8_GRADS: "e5m2" for "delayed"), or None; with one, `grads[index]` is each call site's
    `DelayedScaling` of those cotangents, made with the site. Once every call site has run, a step
    changes the bank only on the device and in place (`scales` by the rule, `past` and its count), so
    a CUDA graph that captured a step advances it at each replay; a step reads its scales from its own
    copy (`Step.snapshot`), which the update at the end of the forward leaves as it ran."""

    def __init__(self, cotangents: str | None = None) -> None:
        self.cotangents = cotangents
        self.grads: dict[int, DelayedScaling] = {}
        self.sites: dict[int, tuple[int, tuple[str, ...]]] = {}
        self.scales: torch.Tensor | None = None
        self.past: AmaxRing | None = None
        self.steps = 0  # (the forwards the host recorded; a CUDA graph's replays count in `past` only)
        # the last recorded forward's: the scales each call site ran at, and its amaxes (by name)
        self.last: dict[int, dict[str, torch.Tensor]] = {}
        self.amaxes: dict[int, dict[str, torch.Tensor]] = {}
        # the process group every amax is reduced over before a scale is set (`reduce_amaxes`), or None
        self.group: Any = None
        # the call sites whose scale names are known to be their block's (added here, or checked after
        # `load_state_dict`)
        self.checked: set[int] = set()

    def reduced(self, amax: torch.Tensor) -> torch.Tensor:
        """`amax` (a vector of amaxes: a forward's, a call site's calibration's, or a backward's of its
        cotangents), the max of every rank's where the bank reduces over a group."""
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return amax

    def add(self, index: int, names: list[str], device: torch.device) -> tuple[int, tuple[str, ...]]:
        """A new call site `index` and its slice, its scales made at 1 (calibrated by the caller), and
        with fp8 cotangents its grad state (calibrated by its first backward)."""
        assert index not in self.sites, index
        if self.cotangents is not None:
            self.grads[index] = self._grad_state()
        self.checked.add(index)  # (its names are its block's: the caller took them from it)
        start = 0 if self.scales is None else self.scales.numel()
        got = self.sites[index] = (start, tuple(names))
        ones = torch.ones(len(names), dtype=torch.float32, device=device)
        self.scales = ones if self.scales is None else torch.cat([self.scales.to(device), ones])
        if self.past is not None:
            self.past.to(device).widen(len(names))
        return got

    def _grad_state(self) -> DelayedScaling:
        """A call site's new grad state of its cotangents' scales, its amaxes reduced as the bank's
        (the identity until `reduce_amaxes` gives a group)."""
        state = DelayedScaling(initial="calibrate", history=HISTORY)
        state.reduce = self.reduced
        return state

    def state_dict(self) -> dict[str, Any]:
        """The scales, their amax history and the cotangents' grad states, by call site: plain tensors,
        lists, strings and numbers (a checkpoint that `torch.load(weights_only=True)` reads)."""
        order = sorted(self.sites.items(), key=lambda kv: kv[1][0])
        return {
            "cotangents": self.cotangents,
            "sites": [[index, list(names)] for index, (_start, names) in order],
            "scales": None if self.scales is None else self.scales.detach().clone(),
            # (the ring's rows as they lie: the next is written at row steps % (HISTORY - 1))
            "past": None if self.past is None else self.past.rows.detach().clone(),
            "steps": self.steps if self.past is None else self.past.pushed(),
            "grads": [[index, self.grads[index].state_dict()] for index, _ in order if index in self.grads],
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """The state `state_dict` gave, on `device`: every call site it holds runs at its scales from the
        next step, and calibrates no more (ValueError for another recipe's state)."""
        if state.get("cotangents") != self.cotangents:
            got, want = state.get("cotangents"), self.cotangents
            raise ValueError(
                f"fp8 state of a model whose cotangents are {got or 'in its dtype'}, loaded into one whose "
                f"are {want or 'in its dtype'}: load it into a model patched with the same fp8 recipe"
            )
        sites, start = {}, 0
        for index, names in state["sites"]:
            sites[int(index)] = (start, tuple(names))
            start += len(names)
        scales = state["scales"]
        if (scales is None) != (not sites) or (scales is not None and scales.numel() != start):
            raise ValueError(
                "fp8 state: its scales do not match its call sites (not a state_dict() of a Bank)"
            )
        grads: dict[int, DelayedScaling] = {}
        for index, gs in state["grads"]:
            grads[int(index)] = g = self._grad_state()
            g.load_state_dict({**gs, "scales": {k: v.to(device) for k, v in gs["scales"].items()}})
        self.sites, self.grads, self.steps = sites, grads, int(state["steps"])
        self.scales = None if scales is None else scales.to(device=device, dtype=torch.float32)
        past = state["past"]
        self.past = None if past is None else AmaxRing.loaded(past, self.steps, device)
        self.last, self.amaxes, self.checked = {}, {}, set()

    def of(self, index: int, step: Any) -> dict[str, torch.Tensor]:
        """Call site `index`'s scales in `step`, by name: 0-d views of the step's copy of `scales`,
        made at its first call site (one copy a step), which the bank's in-place update at the end of
        the forward leaves as they ran (the backward, and activation checkpointing's second run, read
        them after that)."""
        assert self.scales is not None
        snap = step.snapshot
        if snap is None or snap.numel() != self.scales.numel():
            snap = step.snapshot = self.scales.clone()
        start, names = self.sites[index]
        return {n: snap[start + i] for i, n in enumerate(names)}

    def record(self, amaxes: dict[int, dict[str, torch.Tensor]]) -> None:
        """One step's amaxes (by call site and name; every call site that ran): into the history, and
        every scale set by the rule."""
        assert self.scales is not None
        parts: list[torch.Tensor] = []
        for index, (_start, names) in sorted(self.sites.items(), key=lambda kv: kv[1][0]):
            got = amaxes.get(index)
            if got is None:  # (a call site that did not run this step: its amax is no evidence)
                parts.extend(self.scales.new_zeros(()) for _ in names)
            else:
                parts.extend(got[n] for n in names)
        a = self.reduced(f32_row(parts))
        if HISTORY > 1 and self.past is None:  # (its zero rows change no max of amaxes: >= 0 or NaN)
            self.past = AmaxRing(HISTORY - 1, a.numel(), a.device)
        update_scales(a, None if self.past is None else self.past.to(a.device), self.scales, E4M3_MAX)
        self.steps += 1


def run_scaled(
    bank: Bank,
    owner: Any,
    step: Any,
    index: int,
    run: Callable[[dict[str, Any], DelayedScaling | None], dict[str, torch.Tensor]],
    fn: Any,
    inputs: dict[str, Any],
    loras: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """`run(inputs, grad_scales)` (the block function `fn`, run by `owner`) with the delayed scales of
    call site `index` added to `inputs`, and its cotangents' grad state (`Bank.grads`, None without fp8
    cotangents); its amaxes kept in `step.amaxes` for `record`. A call site's second run in one step
    (activation checkpointing's) reuses the first run's scales, with the same grad state, and keeps
    nothing."""
    active = sorted(k for k, v in loras.items() if v is not None)
    if active:
        raise refuse(
            f"{getattr(owner, '_coda_name', type(owner).__name__)}: peft LoRA adapters on {', '.join(active)}",
            "fp8 blocks multiply e4m3 copies of the base weights and have no adapter path yet",
            "patch without fp8= to train LoRA adapters",
        )
    if not scale_names(fn.block):  # fp8="blockwise": current scales, made by the block itself
        if index not in bank.sites:  # (a call site: its cotangents' grad state)
            device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
            bank.add(index, [], device)
        return whole_row_groups(fn.block, inputs, lambda ins: run(ins, bank.grads.get(index)))
    ran = step.scales.get(index)
    if ran is not None:  # (activation checkpointing runs the layer again in the backward)
        return run({**inputs, **{f"s_{n}": s for n, s in ran.items()}}, bank.grads.get(index))
    known = bank.sites.get(index)
    if known is not None:
        names = known[1]
        if index not in bank.checked:  # (a loaded state: its names must be this block's)
            want = tuple(scale_names(fn.block))
            if names != want:
                raise ValueError(
                    f"coda_lang.hf: fp8 state of call site {index} has scales {', '.join(names)}; its "
                    f"block {fn.block.name} takes {', '.join(want)}: " + _why_other(set(names), set(want))
                )
            bank.checked.add(index)
    else:  # calibration: the first step's scales from its own amaxes, measured at scales 1
        refuse_in_capture(
            f"fp8 call site {index} ({fn.block.name}) runs for the first time and calibrates its scales (a "
            "graph would calibrate again at every replay)",
            "run the step once before capturing it",
        )
        names = tuple(scale_names(fn.block))
        device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
        start, _ = bank.add(index, list(names), device)
        assert bank.scales is not None
        with torch.no_grad():  # (no graph: no backward, no grad state)
            out = run({**inputs, **{f"s_{n}": s for n, s in bank.of(index, step).items()}}, None)
        amax = bank.reduced(f32_row([out[f"am_{n}"] for n in names]))
        part = slice(start, start + len(names))
        bank.scales = bank.scales.clone()
        bank.scales[part] = delayed_scales(amax, None, bank.scales[part], E4M3_MAX)
        step.snapshot = None  # (the step's copy is taken again, with these)
    scales = bank.of(index, step)
    out = run({**inputs, **{f"s_{n}": s for n, s in scales.items()}}, bank.grads.get(index))
    step.scales[index] = scales
    step.amaxes[index] = {n: out[f"am_{n}"] for n in names}
    return out


def whole_row_groups(
    block: Any, inputs: dict[str, Any], run: Callable[[dict[str, Any]], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """`run(inputs)` for a block of fp8="blockwise", whose backward quantizes each weight gradient's
    activation again in groups of SCALE_GROUP tokens: at a token count that is not a multiple of it, the
    block's token inputs padded with zero rows (zero activations, positions and targets of no loss:
    they change no amax and add nothing to a weight gradient) and its outputs cut back, both
    differentiable, so that each group is whole; as it is otherwise."""
    tokens = [p.var.name for p in block.ir.params if _on_tokens(p.var.type)]
    m = next((inputs[n].shape[0] for n in tokens if isinstance(inputs.get(n), torch.Tensor)), None)
    if m is None or m % SCALE_GROUP == 0:
        return run(inputs)
    pad = -m % SCALE_GROUP
    padded = {
        k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, pad)) if k in tokens else v
        for k, v in inputs.items()
    }
    out = run(padded)
    return {k: v[:m] if v.dim() and v.shape[0] == m + pad else v for k, v in out.items()}


def _on_tokens(t: Any) -> bool:
    """Whether a block parameter of type `t` has a row per token (its first dim the programs' M)."""
    return (
        t is not None
        and len(t.shape) >= 1
        and getattr(t.shape[0], "name", None) == "M"
        and t.shape[0].coeff == 1
    )


# the scales a layer's call site has under one setting of a variable only: (those scales, the variable,
# its default setting, what the setting changes, the section of docs/models.md that says so)
_SETTINGS = (
    (frozenset({FP8_SAVE_SCALE}), FP8_SAVE_VAR, True, "saved its gate/up accumulators", "fp8 memory"),
    (FP8_OUT_SCALES, FP8_OUT_VAR, True, "ran its out-projection", "fp8 training"),
)


def _why_other(had: set[str], want: set[str]) -> str:
    """Why a loaded state's scales are not a block's: where they differ only by the scales of settings
    (`_SETTINGS`: the gate/up copy's, $CODA_FP8_SAVE_ACC; the out-projection's, $CODA_FP8_OUT), the
    state was saved by a model patched with the other setting of each: named, with what sets the saved
    model's setting again (unset where it is the default)."""
    diff = had ^ want
    parts = []
    for scales, var, default, did, doc in _SETTINGS:
        if scales <= diff and (scales <= had or scales <= want):
            on = scales <= had  # (the saved model's setting)
            how = "in e4m3" if on else "in the model's dtype"
            fix = f"unset {var}" if on == default else f"set {var}={int(on)}"
            parts.append((f"{did} {how} (docs/models.md, {doc})", fix))
            diff = diff - scales
    if diff or not parts:
        return "the state is another model's"
    return (
        "the state is a model's that "
        + " and ".join(w for w, _ in parts)
        + "; "
        + " and ".join(f for _, f in parts)
        + " before patching to resume from it"
    )


def record(bank: Bank | None, step: Any) -> None:
    """The forward's amaxes into the bank (one update for every call site); nothing for a bf16 model."""
    if bank is not None and step.amaxes:
        bank.record(step.amaxes)
        bank.last, bank.amaxes = dict(step.scales), step.amaxes
        step.amaxes = {}


def reduce_amaxes(model: Any, group: Any = None) -> Any:
    """From now on, every forward of `model` (patched with `fp8=`: a transformers model, a peft model
    of one, or either wrapped by DDP or sharded by FSDP2) reduces its fp8 amaxes, the max, over the
    process group `group` before it sets the next scales, and so do each call site's calibration and,
    with fp8="delayed", each call site's backward for its cotangents' scales: every rank quantizes at
    the same scales, those one process on the whole batch would have. `group`: default, a new group of
    every rank (made here: a collective), so that these reductions never queue among the wrapper's
    own. Call it on every rank, before the first step; every rank must then run every forward and
    backward of the model, training or evaluation (each is a collective). Returns `model`.
    ValueError for a model not patched, or patched without fp8; also where torch.distributed has no
    process group."""
    import torch.distributed as dist

    bank = _bank(model)
    name = type(model).__name__
    if not (dist.is_available() and dist.is_initialized()):
        raise refuse(
            name,
            "reducing the fp8 amaxes over data-parallel ranks needs a process group",
            "call torch.distributed.init_process_group() first (torchrun sets its environment)",
        )
    bank.group = dist.new_group() if group is None else group
    return model


def _bank(model: Any) -> Bank:
    inner = peft_inner(getattr(model, "module", model))  # (DDP's module; peft's base model)
    st = getattr(inner, "_coda", None)
    name = type(model).__name__
    if st is None:
        raise refuse(name, "not patched by coda_lang.hf", "patch it with apply_coda(model, fp8=...) first")
    if st.fp8_bank is None:
        raise refuse(name, "patched without fp8: it has no fp8 scales", 'patch it with fp8="delayed"')
    bank: Bank = st.fp8_bank
    return bank


def state_dict(model: Any) -> dict[str, Any]:
    """The fp8 state of `model` (patched with `fp8=`): every call site's delayed scales, their amax
    history and, with fp8="delayed", its cotangents' scales and history; tensors, lists, strings and
    numbers only, for a checkpoint beside `model.state_dict()` (which keeps Hugging Face's names and
    nothing of fp8). `load_state_dict` resumes from it. Under DDP or FSDP2 each rank has its own (the
    same on every rank with `reduce_amaxes`). ValueError for a model not patched, or without fp8."""
    return _bank(model).state_dict()


def load_state_dict(model: Any, state: dict[str, Any]) -> None:
    """Resume `model`'s fp8 scales from `state` (`state_dict`'s, of a model patched with the same
    recipe and of the same layers): its next step runs at the scales the saved model's would have,
    where without it each call site calibrates again. ValueError for a model not patched or without
    fp8, for a state of the other recipe, and (at the next forward) for one of another model."""
    bank = _bank(model)
    first = next(iter(getattr(model, "module", model).parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type == "meta":
        raise refuse(type(model).__name__, "its parameters are on the meta device", "load its weights first")
    bank.load_state_dict(state, device)
