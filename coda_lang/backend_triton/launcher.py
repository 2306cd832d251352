"""Launching coda's Triton kernels without Triton's per-call Python where nothing new is asked of it.

What it does: `launch(kern, grid, *args, **meta)` is `kern[grid](*args, **meta)`. The first launch of
each specialization goes through Triton's JIT (`JITFunction.run`: it binds the arguments, computes the
specialization key, finds or compiles the kernel, launches it) and keeps the compiled kernel it
returns; a later launch whose arguments specialize the same way calls that kernel's launcher
directly, with the arguments in the order the JIT passes them. The JIT's own path costs tens of
microseconds of Python per launch, and a fp8 decoder layer's forward launches a few dozen small
kernels, faster than the GPU runs them only when each launch is cheap.
The key (`_key`) is at least as fine as what Triton 3.x specializes a kernel on, so that a kept kernel
is only ever launched on arguments it was compiled for: for a tensor its dtype and whether its data
pointer is 16-byte aligned; for an int whether it is 1, whether it is a multiple of 16 and its range
(i32, i64, u64); for a bool its value; for a float nothing (fp32, never specialized); the constexpr
and compile options (`meta`) by value; the current device.
What it does not: take the direct path under a torch.compile trace (which records a kernel launched
as `kern[grid](...)`), under Triton's CPU interpreter, while a launch hook is set
(a profiler's: `triton.knobs.runtime.launch_enter_hook`; the JIT then builds the launch metadata the
hook reads), for an argument of another kind (a tuple, a tensor descriptor), or where the constexprs
are not the kernel's trailing parameters: those calls go through the JIT every time, as before.
Invariants: the kernel launched is the one the JIT launched for the same key, on the current device's
current stream, as the JIT launches it; nothing here compiles or reads anything back from the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

_I32 = 2**31
_U = 2**63


def _arg_key(a: Any) -> Any:
    """What Triton may specialize argument `a` on (None: an argument this module does not take)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, -_I32 <= a < _I32, a < _U)
    if isinstance(a, float):
        return "f"
    return None


def _key(args: tuple[Any, ...], meta: dict[str, Any], device: int) -> tuple[Any, ...] | None:
    keys = []
    for a in args:
        k = _arg_key(a)
        if k is None:
            return None
        keys.append(k)
    return (device, tuple(keys), tuple(sorted(meta.items())))


def _unset(hook: Any) -> bool:
    """No launch hook: None (older Triton), or a HookChain with nothing in it (Triton 3.6)."""
    return hook is None or getattr(hook, "calls", None) == []


def _direct(kern: Any) -> bool:
    """Whether `kern` is a GPU kernel of Triton's JIT (not its CPU interpreter's), with no launch hook set."""
    import triton

    if not isinstance(kern, triton.runtime.jit.JITFunction):
        return False
    rt = triton.knobs.runtime
    return _unset(rt.launch_enter_hook) and _unset(rt.launch_exit_hook)


def _stream(device: int) -> int:
    """The current stream of `device`, as Triton's driver asks torch for it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def launch(kern: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """`kern[grid](*args, **meta)`: the arguments positional, the constexprs and options (num_warps) by
    name; see the module docstring."""
    if torch.compiler.is_compiling() or not _direct(kern):  # (a trace records the JIT's launch)
        kern[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    key = _key(args, meta, device)
    kept: dict[Any, Any] = kern.__dict__.setdefault("_coda_kept", {})
    hit = kept.get(key) if key is not None else None
    if hit is None:
        compiled = kern[grid](*args, **meta)
        names = kern.arg_names[len(args) :]
        if (
            key is not None
            and compiled is not None
            and not hasattr(compiled, "result")
            and set(names) <= set(meta)
        ):
            consts = tuple(meta[n] for n in names)
            kept[key] = (compiled.run, compiled.function, compiled.packed_metadata, consts)
        return
    run, function, packed, consts = hit
    g = (*grid, 1, 1)
    # (launch metadata and hooks None: the hooks are unset, which is what the launcher then checks)
    run(g[0], g[1], g[2], _stream(device), function, packed, None, None, None, *args, *consts)


__all__ = ["launch"]
