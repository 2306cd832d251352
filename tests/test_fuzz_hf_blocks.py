"""scripts/fuzz_hf_blocks.py (`coda fuzz` on every block a patched Hugging Face model runs), on the CPU.

- The runs: each family's program under bf16 and each fp8 recipe, the families that write the same
  program fuzzed once (Llama, Mistral, Ministral and Phi-3), each block with the backward options and
  the parameters the patch derives it with; the programs are what `coda_lang.hf` writes (the recipe's
  header, the e4m3 save's copy where the recipe saves it); the loss and logits heads under bf16 only,
  with their chunked backwards.
- One block fuzzed on the emulated kernels passes (exit 0, one line per run and a summary); a run that
  fails (here: an option `coda fuzz` refuses) is reported with its command and output, exit 1.
- Unknown names are usage errors (exit 2).
- gpu_check.sh runs it on the GPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "fuzz_hf_blocks.py"


def test_the_runs_cover_every_family_recipe_and_block(tmp_path: Path) -> None:
    from coda_lang.api import load
    from coda_lang.hf.family import FAMILIES

    s = script("fuzz_hf_blocks")
    runs = s.runs(list(FAMILIES), list(s.RECIPES), list(s.BLOCKS), tmp_path)
    programs = {(r.families, r.recipe) for r in runs}
    # every family is in exactly one program of each recipe
    for recipe in s.RECIPES:
        named = [f for fams, rec in programs if rec == recipe for f in fams]
        assert sorted(named) == sorted(FAMILIES), recipe
    same = next(fams for fams, _ in programs if "llama" in fams)
    assert same == ("llama", "mistral", "ministral", "phi3"), same
    distinct = {fams for fams, _ in programs}
    layers, heads = len(s.LAYERS), len(s.HEADS)
    # (and loss_mode="fp8"'s head once a program of recipe "delayed")
    assert len(distinct) == 7 and len(runs) == 7 * (len(s.RECIPES) * layers + heads + 1)
    programs_by_path: dict[Path, Any] = {}
    for r in runs:
        text = r.path.read_text()
        if r.path not in programs_by_path:
            programs_by_path[r.path] = load(text)
        block = programs_by_path[r.path][r.block]
        fp8, save, flags = s.RECIPES[r.recipe]
        header = text.splitlines()[0]
        # (both delayed recipes write one program, "fp8 delayed"; they differ in the backward's options)
        assert ("fp8 delayed" in header) == (fp8 in ("delayed", "delayed-forward")), (r.name, header)
        assert ("fp8 blockwise" in header) == (fp8 == "blockwise"), (r.name, header)
        assert ("u1q: e4m3 = acc * c1" in text) == save, r.name
        assert ("yq: e4m3 = y * s_y" in text) == (r.recipe == "delayed-out"), r.name
        assert ("--fp8-acc" in flags) == save and ("--fp8-grads" in flags) == (
            fp8 in ("delayed", "blockwise")
        )
        assert ("--requantize-wgrad" in flags) == (fp8 == "blockwise"), r.name
        if r.block in s.HEADS:
            assert r.recipe == "bf16" and r.flags == s.HEADS[r.block], r.name
        elif r.block == s.FP8_HEAD:
            assert r.recipe == "delayed" and r.flags == ("--fp8-grads", "e5m2"), r.name
        else:
            assert r.flags == flags, r.name
        # differentiated as the patch does: weights and activations, never a scale or a target
        params = {p.var.name for p in block.ir.params}
        assert set(r.wrt) <= params and not any(w.startswith("s_") for w in r.wrt), r.wrt
        assert "target" not in r.wrt and any(w.startswith("w_") for w in r.wrt), r.wrt
        cmd = s.command(r, argparse.Namespace(target="emulate", examples=3, seed=7, special=False))
        assert cmd[3:] == [
            "fuzz",
            str(r.path),
            "--block",
            r.block,
            "--target",
            "emulate",
            "--examples",
            "3",
        ] + [
            "--seed",
            "7",
            "-q",
            "--wrt",
            ",".join(r.wrt),
            *r.flags,
        ]
    loss = next(r for r in runs if r.block == "head_loss" and "llama" in r.families)
    assert loss.flags == ("--chunk-dim", "V"), loss.flags  # the "vocab" loss mode's chunked backward
    # the head dims: Qwen3's per-head norm at its own 128, Gemma's 256
    qwen3 = next(r for r in runs if r.families == ("qwen3",))
    assert "head_dim 128" in qwen3.path.read_text().splitlines()[0]


def test_one_block_passes_emulated(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    code = script("fuzz_hf_blocks").main(
        ["--target", "emulate", "--families", "qwen3", "--recipes", "delayed", "--blocks", "layer"]
        + ["--examples", "1", "--jobs", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ok   qwen3/delayed/layer" in out and "ok: layer: 1 cases" in out, out
    assert "--fp8-grads e5m2 --fp8-acc" in out
    assert out.strip().splitlines()[-1].startswith("1 of 1 blocks passed (target emulate"), out


def test_kernel_plans_need_the_emulated_target(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        script("fuzz_hf_blocks").main(["--kernel-plans", "--families", "llama"])
    assert e.value.code == 2 and "give --target emulate" in capsys.readouterr().err


@pytest.mark.slow
def test_every_fp8_block_passes_on_the_kernels_plans(capsys: pytest.CaptureFixture[str]) -> None:
    """Every family's fp8 blocks (both e5m2 recipes) on the plans the GPU kernels get (K-major
    copies, values stored as their copy alone, the fp8 pairs as words), each kernel replaced by its
    torch stand-in, against the interpreter: what `--target cuda` checks of those plans, on the CPU."""
    pytest.importorskip("torch")
    code = script("fuzz_hf_blocks").main(
        ["--target", "emulate", "--kernel-plans", "--recipes", "delayed,delayed-save16"]
        + ["--blocks", "first_qkv,layer,last", "--examples", "1", "--jobs", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAIL" not in out and " blocks passed (target emulate" in out.strip().splitlines()[-1], out


def test_a_failing_run_fails_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    s = script("fuzz_hf_blocks")
    # a recipe whose fuzz options coda fuzz refuses: the run exits 2, the script reports it and exits 1
    monkeypatch.setitem(s.RECIPES, "delayed", ("delayed", True, ("--fp8-grads", "e3m4")))
    code = s.main(
        ["--target", "emulate", "--families", "llama", "--recipes", "delayed", "--blocks", "first_qkv"]
        + ["--examples", "1", "--jobs", "1"]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL llama/delayed/first_qkv" in out and "== llama/delayed/first_qkv (exit 2)" in out, out
    assert "--fp8-grads e3m4" in out and "invalid choice" in out, out
    assert out.strip().splitlines()[-1].startswith("0 of 1 blocks passed"), out


@pytest.mark.parametrize(
    "flag, value", [("--families", "llama,nope"), ("--recipes", "current"), ("--blocks", "head")]
)
def test_unknown_names_are_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        script("fuzz_hf_blocks").main([flag, value, "--list"])
    out = capsys.readouterr()
    assert e.value.code == 2 and "unknown" in out.err and "Traceback" not in out.err, out.err
    assert out.out == ""


def test_gpu_check_runs_it() -> None:
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "scripts/fuzz_hf_blocks.py --target cuda" in text
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0


def test_list_prints_the_commands_and_keeps_the_programs(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "--recipes", "bf16", "--families", "llama,mistral", "--keep"]
        + [str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 6 and all(" -m coda_lang.cli fuzz " in ln for ln in lines), r.stdout
    assert all(ln.endswith("(also mistral)") for ln in lines), r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-bf16.coda"]
    for ln in lines:
        path = ln.split(" fuzz ")[1].split(" --block ")[0]
        assert Path(path).is_file(), path
