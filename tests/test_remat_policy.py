"""The saved-tensor policy (autodiff/policy.py) and `remat=` on a stage.

- Every example under every policy (save, recompute, auto): the backward checks, its printed form (and
  the extended forward's) loads back the same, its gradients match a central finite difference in
  float64 (an independent reference: it runs the forward only), and equal the `save` gradients in
  float64; in exact precision they stay as close to float64 as `save`'s do; tile mode equals whole mode.
- llama_mlp under auto: `a` and `hg` are not saved (the saved bytes per row drop from 4*D + 6*F + 4 to
  2*D + 4*F + 4), `a` is stored by the SwiGLU-backward stage in bf16 and its wgrad GEMM runs after it;
  `h` stays saved (recomputing it would need stage 1's acc: no fewer bytes).
- `save` is the derivation of before (no recompute notes, every saved tensor of before).
- `remat=` on a stage: parsed, printed, overriding the block-wide policy both ways, refused (E0211)
  when bad; random programs under auto and recompute have checked backwards and the same gradients.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from support import coda, stage_option_error
from test_autodiff import (
    FD_NAMES,
    GRAD_NAMES,
    TILES,
    _forward_case,
    example,
    example_dims,
    example_inputs,
)

import coda_lang
from coda_lang.ir.nodes import Stage
from coda_lang.testing import Forward, forward_blocks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
POLICIES = ["save", "recompute", "auto"]


def _cotangents(block: coda_lang.Block, inputs: dict[str, Any], dims: dict[str, int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    outs = block.run(inputs, dims=dims, precision="f64")
    return {k: rng.standard_normal(np.shape(v)) for k, v in outs.items() if np.asarray(v).dtype.kind == "f"}


def _fd_check(block: coda_lang.Block, inputs: dict[str, Any], dims: dict[str, int], remat: str) -> None:
    """<grad, d> from the backward of `remat` against a central finite difference of <f(x), ct> in
    float64, in 3 random directions d."""
    cts = _cotangents(block, inputs, dims, 7)
    grads = block.vjp(inputs, cts, dims=dims, precision="f64", remat=remat)
    rng = np.random.default_rng(11)

    def f(moved: dict[str, Any]) -> tuple[float, float]:
        outs = block.run(moved, dims=dims, precision="f64")
        vals = [np.asarray(outs[k], np.float64) * c for k, c in cts.items()]
        return sum(float(np.sum(v)) for v in vals), sum(float(np.sum(np.abs(v))) for v in vals)

    eps = 1e-6
    for _ in range(3):
        dirs = {k: rng.standard_normal(np.shape(inputs[k])) for k in grads}
        plus = {**inputs, **{k: np.asarray(inputs[k], np.float64) + eps * d for k, d in dirs.items()}}
        minus = {**inputs, **{k: np.asarray(inputs[k], np.float64) - eps * d for k, d in dirs.items()}}
        (fp, scale), (fm, _) = f(plus), f(minus)
        fd = (fp - fm) / (2 * eps)
        prods = [np.asarray(grads[k], np.float64) * d for k, d in dirs.items()]
        an = sum(float(np.sum(p)) for p in prods)
        tol = 1e-6 * sum(float(np.sum(np.abs(p))) for p in prods) + 1e-14 * scale / eps
        assert abs(fd - an) <= tol, f"{block.name} --remat {remat}: fd {fd!r} vs vjp {an!r}"


@pytest.mark.parametrize("remat", POLICIES)
@pytest.mark.parametrize("name", FD_NAMES)
def test_every_example_under_every_policy(name: str, remat: str) -> None:
    blk, dims, inputs = example(name), example_dims(name), example_inputs(name)
    d = blk.derivation(remat=remat)  # checked: CodaError (E0601) if either block does not check
    for b in (d.forward, d.backward):
        assert coda_lang.load(str(b))[b.name].ir == b.ir  # printed, it loads back the same
    _fd_check(blk, inputs, dims, remat)
    cts = _cotangents(blk, inputs, dims, 5)
    got = blk.vjp(inputs, cts, dims=dims, precision="f64", remat=remat)
    want = blk.vjp(inputs, cts, dims=dims, precision="f64", remat="save")
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-13, err_msg=f"{name} d{k}")
    for tile in TILES.get(name, [(4, 6)]):
        tiled = blk.vjp(inputs, cts, dims=dims, precision="f64", remat=remat, sim_tile=tile)
        for k in want:
            np.testing.assert_allclose(
                tiled[k], want[k], rtol=1e-12, atol=1e-13, err_msg=f"{name} d{k} {tile}"
            )


@pytest.mark.parametrize("remat", ["recompute", "auto"])
@pytest.mark.parametrize("name", GRAD_NAMES)
def test_exact_precision_under_every_policy(name: str, remat: str) -> None:
    """A tile recomputed in an epilogue is computed from what the backward reads (bf16 copies), not from
    the forward's f32 values: its rounding may differ from the forward's stored copy by an ulp. The
    gradients stay within twice save's distance to float64 (plus 1% of the largest entry)."""
    blk, dims, inputs = example(name), example_dims(name), example_inputs(name, seed=3)
    cts = _cotangents(blk, inputs, dims, 3)
    g64 = blk.vjp(inputs, cts, dims=dims, precision="f64")
    save = blk.vjp(inputs, cts, dims=dims, precision="exact", remat="save")
    got = blk.vjp(inputs, cts, dims=dims, precision="exact", remat=remat)
    for k in g64:
        top = float(np.max(np.abs(g64[k]))) if np.size(g64[k]) else 0.0
        e_save = float(np.max(np.abs(np.asarray(save[k], np.float64) - g64[k]))) if top else 0.0
        e_got = float(np.max(np.abs(np.asarray(got[k], np.float64) - g64[k]))) if top else 0.0
        assert e_got <= 2 * e_save + 0.01 * top, (k, e_got, e_save)


def _gemms(bwd: coda_lang.Block) -> list[Stage]:
    return [s for s in bwd.ir.stages if s.is_gemm]


def test_llama_mlp_auto_recomputes_a_in_the_swiglu_backward() -> None:
    blk = example("llama_mlp")
    save, auto = blk.derivation(remat="save"), blk.derivation(remat="auto")
    assert save.saved == ("a", "acc2", "r", "hg", "h")
    assert auto.saved == ("acc2", "r", "h")
    assert "# saved per row: 4*D + 6*F + 4 bytes (--remat save)" in str(save.backward)
    assert "# saved per row: 2*D + 4*F + 4 bytes (--remat auto)" in str(auto.backward)
    assert [o.name for o in auto.forward.ir.outputs] == ["x2", "acc2", "r", "h"]  # no extra output a, hg
    assert [p.var.name for p in auto.backward.ir.params if p.var.name in ("a", "hg")] == []
    stages = auto.backward.ir.stages
    k = next(i for i, s in enumerate(stages) if s.a is not None and s.a.name == "dx2" and s.tb)
    st = stages[k]
    assert st.b is not None and st.b.name == "w_2"  # the dgrad of stage 3: stage 2's backward
    (e,) = [e for e in st.body if any(v.name == "a" for v in e.outs)]
    assert e.outs[0].annot == "bf16"  # stored as the forward stores it
    wgrad = next(i for i, s in enumerate(stages) if s.a is not None and s.a.name == "a")
    assert stages[wgrad].ta and stages[wgrad].b.name == "dx2" and wgrad > k  # type: ignore[union-attr]
    (e,) = [e for s in stages for e in s.body if any(v.name == "hg" for v in e.outs)]
    assert e.outs[0].annot == "bf16"
    assert len(_gemms(auto.backward)) == len(_gemms(save.backward))  # no forward GEMM runs again
    notes = "\n".join(auto.report)
    assert re.search(
        r"`a` \(line \d+\) is recomputed in the epilogue that runs stage 2's backward.*2\*F bytes", notes
    )
    assert re.search(r"`hg` \(line \d+\) is recomputed .*2\*D bytes", notes)
    assert re.search(r"`h` \(line \d+\) stays saved", notes)


def test_coda_grad_auto_prints_the_policy_and_saves_no_a(tmp_path: Path) -> None:
    r = coda("grad", EXAMPLES / "llama_mlp.coda", "--remat", "auto")
    assert r.returncode == 0, r.stderr
    head = [line for line in r.stdout.splitlines() if line.startswith("#")]
    assert "# saved tensors (stored by the forward): acc2, r, h" in head
    assert "# saved bytes per row: acc2 4*F, r 4, h 2*D" in head
    assert not re.search(r"\ba: bf16\[", r.stdout)  # no parameter `a`
    assert "    a: bf16 = " in r.stdout  # stored by the SwiGLU-backward stage
    assert "is recomputed in the epilogue" in r.stderr
    out = tmp_path / "bwd.coda"
    out.write_text(r.stdout)
    c = coda("check", out)
    assert c.returncode == 0, c.stdout + c.stderr


@pytest.mark.parametrize("remat", POLICIES)
def test_coda_check_accepts_every_printed_backward(remat: str, tmp_path: Path, capsys: Any) -> None:
    """`coda grad --with-forward -o` on every example, then `coda check` on what it wrote: both commands'
    `main`, in this process (one `coda` process per example and policy would cost a start each;
    test_cli_grad.py runs the real command line)."""
    from coda_lang.cli import main

    for name in GRAD_NAMES:
        out = tmp_path / f"{name}.coda"
        code = main(
            ["grad", str(EXAMPLES / f"{name}.coda"), "--remat", remat, "--with-forward", "-o", str(out)]
        )
        assert code == 0, capsys.readouterr().err
        code = main(["check", str(out)])
        assert code == 0, (name, capsys.readouterr())


def test_save_is_the_derivation_of_before() -> None:
    """Under save nothing is recomputed: every saved tensor of before, no recompute note, the goldens."""
    for name in GRAD_NAMES:
        d = example(name).derivation(remat="save")
        assert not any("recomputed" in line or "runs again" in line for line in d.report), name
    assert example("llama_block").derivation(remat="save").saved == (
        "acc4", "r2", "x2g", "x2", "a", "acc2", "r1", "x1g", "x1",
    )  # fmt: skip
    assert example("lm_head_ce").derivation(remat="save").saved == ("acc1", "lse")


def test_auto_is_never_worse_than_save_and_recompute_runs_more() -> None:
    """Saved bytes per row, as a polynomial in the dims: auto holds no term more than save."""
    from coda_lang.autodiff.assemble import row_bytes

    def held(d: Any) -> dict:
        types = {p.var.name: p.var.type for p in d.backward.ir.params}
        return row_bytes([types[n] for n in d.saved])

    for name in GRAD_NAMES:
        blk = example(name)
        s, a = held(blk.derivation(remat="save")), held(blk.derivation(remat="auto"))
        assert all(a.get(k, 0) <= s.get(k, 0) for k in set(a) | set(s)), (name, a, s)
    lm = example("lm_head_ce")
    assert lm.derivation(remat="auto").saved == ("lse",)  # the loss head: its GEMM runs again


# ---------------------------------------------------------------------------- remat= on a stage

MLP = (EXAMPLES / "llama_mlp.coda").read_text()
LM = (EXAMPLES / "lm_head_ce.coda").read_text()


def test_stage_option_is_parsed_and_printed() -> None:
    text = MLP.replace("gemm hg @ w_13 {", 'gemm hg @ w_13, remat="save" {')
    blk = coda_lang.load(text)["llama_mlp"]
    assert [s.remat for s in blk.ir.stages] == [None, "save", None]
    assert 'gemm hg @ w_13, remat="save" {' in str(blk)
    assert coda_lang.load(str(blk))["llama_mlp"].ir == blk.ir
    bare = coda_lang.load(MLP.replace("gemm hg @ w_13 {", "gemm hg @ w_13, remat=save {"))["llama_mlp"]
    assert bare.ir == blk.ir  # quoted or not
    assert blk.ir != coda_lang.load(MLP)["llama_mlp"].ir


def test_save_on_a_stage_overrides_auto() -> None:
    blk = coda_lang.load(MLP.replace("gemm hg @ w_13 {", 'gemm hg @ w_13, remat="save" {'))["llama_mlp"]
    d = blk.derivation(remat="auto")
    assert d.saved == ("a", "acc2", "r", "h")  # a stays saved (its stage says save), hg is recomputed
    assert '(--remat auto; stage 2: remat="save")' in str(d.backward)
    assert blk.derivation(remat="save").saved == ("a", "acc2", "r", "hg", "h")


def test_recompute_on_a_stage_overrides_save(tmp_path: Path) -> None:
    text = LM.replace("gemm hg @ w_lm {", 'gemm hg @ w_lm, remat="recompute" {')
    assert text != LM
    blk = coda_lang.load(text)["lm_head_ce"]
    d = blk.derivation(remat="save")  # the stage's remat= overrides even save
    assert d.saved == ("lse",)
    assert any(
        "runs again in the backward" in line and 'remat="recompute" on the stage' in line for line in d.report
    )
    assert blk.derivation(remat="auto").backward.ir == d.backward.ir
    rng = np.random.default_rng(0)
    m, dd, v = 6, 5, 9
    ins = {
        "hg": rng.standard_normal((m, dd)),
        "r": rng.uniform(0.5, 1.5, m),
        "w_lm": rng.standard_normal((dd, v)),
        "target": rng.integers(0, v, m).astype(np.int32),
    }
    _fd_check(blk, ins, {}, "save")
    f = tmp_path / "lm.coda"
    f.write_text(text)
    r = coda("grad", f, "--with-forward")
    assert r.returncode == 0 and not re.search(r"\bacc1\b", r.stdout), r.stderr
    assert 'gemm hg @ w_lm, remat="recompute" {' in r.stdout  # the forward keeps its option
    (tmp_path / "out.coda").write_text(r.stdout)
    assert coda("check", tmp_path / "out.coda").returncode == 0


@pytest.mark.parametrize(
    "option, message",
    [
        (
            'remat="sometimes"',
            '`remat=` of a stage is one of "auto", "save", "recompute", "rebuild", not `"sometimes"`',
        ),
        ("remat=recomputed", "not `recomputed`"),
        ("tile=128", "a stage has no option `tile=`"),
        ('remat="save", remat="auto"', "`remat=` is given twice on one stage"),
    ],
)
def test_bad_stage_option(option: str, message: str, tmp_path: Path) -> None:
    text = MLP.replace("gemm hg @ w_13 {", f"gemm hg @ w_13, {option} {{")
    stage_option_error(text, "gemm hg @ w_13", message, tmp_path)


# ---------------------------------------------------------------------------- random programs


@settings(
    max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], deadline=None
)
@given(forward_blocks())
def test_random_forwards_under_every_policy(fwd: Forward) -> None:
    block, inputs = _forward_case(fwd, 0)
    cts = _cotangents(block, inputs, fwd.dims, 1)
    want = block.vjp(inputs, cts, dims=fwd.dims, precision="f64", remat="save")
    for remat in ("recompute", "auto"):
        d = block.derivation(remat=remat)  # CodaError (E0601) fails the test
        assert coda_lang.load(str(d.backward))[d.backward.name].ir == d.backward.ir, fwd.text
        got = block.vjp(inputs, cts, dims=fwd.dims, precision="f64", remat=remat)
        for k in want:
            np.testing.assert_allclose(
                got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=f"{remat} d{k}\n{fwd.text}"
            )
