"""backend_triton/launcher.py: a kernel's later launches go straight to the kernel Triton compiled for
the same specialization, and only then.

- On the CPU, a real `triton.jit` function whose JIT launch is replaced by a recorder (no GPU to
  compile for): the first launch of a specialization goes through the JIT, a later one with arguments
  that specialize the same way calls the kept kernel's launcher with the JIT's argument order (the
  arguments, then the constexprs in parameter order); each thing Triton specializes on (a tensor's
  dtype and 16-byte alignment, an int that is 1, a multiple of 16 or past i32, a bool's value, the
  constexprs and num_warps, the device) makes a launch go through the JIT again; a float does not.
  Triton's CPU interpreter, a set launch hook, an argument of another kind and a constexpr left to
  its default go through the JIT every time.
- On a GPU: the conversion, transpose and interleave kernels launched many times, on aligned and
  misaligned inputs, against torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

import coda_lang.backend_triton.launcher as launcher


@triton.jit
def _probe(x, y, n, scale, flag, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 2):  # pragma: no cover
    pass


class _Compiled:
    """What the JIT returns: a compiled kernel, whose launcher records its calls."""

    def __init__(self, log: list[Any]):
        self.function, self.packed_metadata = "fn", "meta"
        self.log = log

    def run(self, *a: Any) -> None:
        self.log.append(("direct", a))


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Any:
    log: list[Any] = []
    kern = _probe
    kern.__dict__.pop("_coda_kept", None)

    def jit_run(*args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        log.append(("jit", grid, args, kw))
        c = _Compiled(log)
        return c

    monkeypatch.setattr(kern, "run", jit_run, raising=False)
    monkeypatch.setattr(launcher.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_stream", lambda device: 1000 + device)
    yield kern, log
    kern.__dict__.pop("_coda_kept", None)


def _t(n: int = 64, dtype: torch.dtype = torch.bfloat16, offset: int = 0) -> torch.Tensor:
    return torch.zeros(n + 8, dtype=dtype)[offset : offset + n]


def test_a_second_launch_goes_straight_to_the_kept_kernel(probe: Any) -> None:
    kern, log = probe
    x, y = _t(), _t()
    launcher.launch(kern, (4,), x, y, 64, 0.5, True, BLOCK=128, EXTRA=3, num_warps=4)
    assert [e[0] for e in log] == ["jit"]
    assert log[0][1] == (4,) and log[0][3] == {"BLOCK": 128, "EXTRA": 3, "num_warps": 4}
    x2, y2 = _t(), _t()
    launcher.launch(kern, (7, 2), x2, y2, 64, 0.25, True, BLOCK=128, EXTRA=3, num_warps=4)
    kind, a = log[-1]
    assert kind == "direct"
    # grid padded to three, the current stream, the kernel, its metadata, no launch metadata or hooks,
    # then the arguments and the constexprs in parameter order (BLOCK, EXTRA)
    assert a[:9] == (7, 2, 1, 1000, "fn", "meta", None, None, None)
    assert a[9:11] == (x2, y2) and a[11:] == (64, 0.25, True, 128, 3)
    assert len(log) == 2


@pytest.mark.parametrize(
    "change",
    [
        "dtype",
        "misaligned",
        "int one",
        "int not 16",
        "int past i32",
        "bool",
        "constexpr",
        "num_warps",
        "device",
    ],
)
def test_what_triton_specializes_on_goes_through_the_jit(
    probe: Any, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kern, log = probe
    base: dict[str, Any] = dict(x=_t(), n=64, flag=True, BLOCK=128, num_warps=4)

    def go(**kw: Any) -> None:
        a = {**base, **kw}
        launcher.launch(
            kern,
            (1,),
            a["x"],
            _t(),
            a["n"],
            1.5,
            a["flag"],
            BLOCK=a["BLOCK"],
            EXTRA=2,
            num_warps=a["num_warps"],
        )

    go()
    go()
    assert [e[0] for e in log] == ["jit", "direct"]
    other = {
        "dtype": dict(x=_t(dtype=torch.float16)),
        "misaligned": dict(x=_t(offset=1)),  # 2 bytes past a 16-byte boundary
        "int one": dict(n=1),
        "int not 16": dict(n=65),
        "int past i32": dict(n=2**31 + 16),
        "bool": dict(flag=False),
        "constexpr": dict(BLOCK=256),
        "num_warps": dict(num_warps=8),
    }.get(change, {})
    if change == "device":
        monkeypatch.setattr(launcher.torch.cuda, "current_device", lambda: 1)
    go(**other)
    assert log[-1][0] == "jit", change
    go(**other)  # (kept under its own key)
    assert log[-1][0] == "direct", change


def test_a_float_is_not_specialized(probe: Any) -> None:
    kern, log = probe
    for s in (0.5, 1.0, 16.0, -3.25):
        launcher.launch(kern, (1,), _t(), _t(), 64, s, True, BLOCK=128, EXTRA=2)
    assert [e[0] for e in log] == ["jit", "direct", "direct", "direct"]
    assert [e[1][12] for e in log[1:]] == [1.0, 16.0, -3.25]


def test_what_is_not_taken_goes_through_the_jit_every_time(
    probe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kern, log = probe
    # a constexpr left to its default (EXTRA): the JIT's argument order would need it
    for _ in range(2):
        launcher.launch(kern, (1,), _t(), _t(), 64, 1.0, True, BLOCK=128)
    # an argument of another kind
    for _ in range(2):
        launcher.launch(kern, (1,), _t(), _t(), (64,), 1.0, True, BLOCK=128, EXTRA=2)
    assert [e[0] for e in log] == ["jit"] * 4
    # a launch hook set (a profiler's): the JIT builds the metadata it reads
    launcher.launch(kern, (1,), _t(), _t(), 64, 1.0, True, BLOCK=128, EXTRA=2)
    hooks = triton.knobs.runtime
    calls = getattr(hooks.launch_enter_hook, "calls", None)
    if calls is None:  # (a Triton whose hooks are plain attributes)
        monkeypatch.setattr(hooks, "launch_enter_hook", lambda *a: None)
    else:
        monkeypatch.setattr(hooks.launch_enter_hook, "calls", [lambda *a: None])
    launcher.launch(kern, (1,), _t(), _t(), 64, 1.0, True, BLOCK=128, EXTRA=2)
    assert [e[0] for e in log] == ["jit"] * 6


def test_a_torch_compile_trace_gets_the_jit_launch(probe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a torch.compile trace the launch is written `kern[grid](...)`, which the trace records
    (a kept kernel's launcher is not something it can follow)."""
    kern, log = probe
    launcher.launch(kern, (1,), _t(), _t(), 64, 1.0, True, BLOCK=128, EXTRA=2)
    monkeypatch.setattr(launcher.torch.compiler, "is_compiling", lambda: True)
    launcher.launch(kern, (1,), _t(), _t(), 64, 1.0, True, BLOCK=128, EXTRA=2)
    assert [e[0] for e in log] == ["jit", "jit"]


def test_the_interpreter_is_never_bypassed() -> None:
    from coda_lang.backend_triton import layouts

    src = torch.randn(1000).to(torch.float8_e4m3fn)
    for _ in range(3):
        out = layouts.widen(src, torch.float32, interpret=True)
        assert torch.equal(out, src.float())
    assert "_coda_kept" not in layouts._kernel("convert", True).__dict__


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_kernels_launched_directly_match_torch() -> None:
    from coda_lang.backend_triton import layouts

    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(5000, device="cuda", generator=g)
    for rep in range(4):
        for off in (0, 1, 3):  # aligned, then misaligned by 1 and 3 bytes of an fp8 tensor
            src = base.to(torch.float8_e4m3fn)[off : off + 4096]
            assert torch.equal(layouts.widen(src, torch.bfloat16), src.to(torch.bfloat16)), (rep, off)
            mat = src[: 64 * 48].view(64, 48)
            assert torch.equal(
                layouts.transposed(mat).view(torch.uint8), mat.t().contiguous().view(torch.uint8)
            )
        a = torch.randn(33, 40, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(33, 40, device="cuda", dtype=torch.bfloat16, generator=g)
        want = torch.stack((a, b), dim=-1).reshape(33, 80)
        assert torch.equal(layouts.interleave(a, b), want)
    assert layouts._kernel("convert", False).__dict__.get("_coda_kept")
