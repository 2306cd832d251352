"""`Block.run`, `vjp` and `grad` validate their arguments: a CodaError naming the argument, never a
silent acceptance or a Python exception from deep inside (cases found by trying it as a careless user
would)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import coda, no_traceback

import coda_lang
from coda_lang.interp import random_inputs

MLP = coda_lang.load("examples/llama_mlp.coda")["llama_mlp"]
SIZES = {"M": 16, "D": 8, "F": 8}
INS = random_inputs(MLP.ir, SIZES, 0)


def _error(f: Any) -> str:
    with pytest.raises(coda_lang.CodaError) as e:
        f()
    return str(e.value)


@pytest.mark.parametrize(
    ("tile", "message"),
    [
        ({7: (4, 4)}, "sim_tile= names stage 7, but block llama_mlp has stages 1 to 3"),
        ({0: (4, 4)}, "sim_tile= names stage 0"),
        ({"1": (4, 4)}, "sim_tile= names stage '1'"),
        ({1: (4, 4.5)}, "sim_tile= of stage 1 is (4, 4.5)"),
        ((True, True), "sim_tile= is (True, True)"),
        ((4,), "sim_tile= is (4,)"),
        ("4x4", "sim_tile= is '4x4'"),
    ],
)
def test_a_bad_tile_is_e0805(tile: Any, message: str) -> None:
    for call in (
        lambda: MLP.run(INS, sim_tile=tile),
        lambda: MLP.run_with_partials(INS, sim_tile=tile),
        lambda: MLP.vjp(INS, {"x2": np.ones((16, 8))}, sim_tile=tile),
    ):
        text = _error(call)
        assert "E0805" in text and message in text, text


def test_good_tiles_still_run() -> None:
    whole = MLP.run(INS, precision="f64")["x2"]
    for tile in ((4, 4), [8, 4], {1: (4, 4), 3: (8, 8)}, {2: (np.int64(4), np.int64(4))}):
        np.testing.assert_allclose(MLP.run(INS, precision="f64", sim_tile=tile)["x2"], whole, rtol=1e-10)


@pytest.mark.parametrize("dtype", ["V4", [("a", "f4")], "U3", "O"], ids=["void", "record", "str", "object"])
def test_arrays_of_non_numbers_are_e0803(dtype: Any) -> None:
    bad = np.zeros((16, 8), dtype=dtype) if dtype != "O" else np.full((16, 8), None, dtype=object)
    text = _error(lambda: MLP.run({**INS, "y": bad}))
    assert "E0803" in text and "input `y`" in text, text


def test_wrt_mistakes_are_argument_errors() -> None:
    """A `wrt=` that is not a list of names is a TypeError, a name that is no parameter a ValueError
    (argument mistakes, not CodaErrors), on every entry that takes it."""
    with pytest.raises(
        TypeError, match=r"wrt= takes a list of parameter names, got 'w_o' \(write wrt=\['w_o'\]\)"
    ):
        MLP.grad(wrt="w_o")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got \\[3\\]"):
        MLP.derivation([3])  # type: ignore[list-item]
    for call in (
        lambda: MLP.grad(wrt=["nope"]),
        lambda: MLP.vjp(INS, {}, wrt=["nope"]),
        lambda: MLP.cuda(emulate=True).autograd(["nope"]),
    ):
        with pytest.raises(
            ValueError, match="wrt= names `nope`, which is not a parameter of block llama_mlp"
        ):
            call()
    assert [o.name for o in MLP.grad(wrt=["w_o"]).ir.outputs] == ["dw_o"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "examples/llama_mlp.coda", "--dims", "M=100000000"], "error[E0808]: at M=100000000"),
        (
            ["run", "examples/llama_mlp.coda", "--dims", "M=4096,D=4096,F=4096", "--sim-tile", "1x1"],
            "error[E0808]: a 1x1 tile makes 16,777,216 tiles",
        ),
        (["fuzz", "examples/llama_mlp.coda", "--max-dim", "100000000"], "--max-dim 100000000 is more than"),
        (["fuzz", "examples/llama_mlp.coda", "--dims", "M=100000000"], "--dims M=100000000 is more than"),
    ],
)
def test_sizes_that_cannot_be_had_are_refused_up_front(args: list[str], message: str) -> None:
    r = coda(*args, timeout=60)  # answered at once: nothing is allocated or simulated first
    no_traceback(r)
    assert r.returncode in (1, 2) and message in r.stderr and not r.stdout, r.stderr


def test_block_run_refuses_a_tile_count_it_cannot_simulate() -> None:
    from coda_lang.interp.inputs import MAX_TILES

    text = _error(lambda: MLP.run(random_inputs(MLP.ir, {"M": 1024, "D": 512, "F": 512}, 0), sim_tile=(1, 1)))
    assert "E0808" in text and f"{MAX_TILES:,}" in text
