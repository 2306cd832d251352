"""benchmarks/launch_count.py (the launches of a training step by kind, counted on the CPU): at 4
layers, the fp8 step launches what its blocks say it does. The GEMM launches are each block's GEMM
stages times its call sites; the combines saved by folding sink partials whole are each block's
`whole_folds` times its call sites; the amax folds batched are each block's `batched_folds` times its call sites, one call a block run;
the transposes are those its plans leave to the runtime: one a block (the GEMM epilogues store the
other copies; more with $CODA_KMAJOR_STORE=0), none with $CODA_KMAJOR_STAGES=all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "launch_count.py"
LAYERS = 4


def _rows(tmp_path: Path, **env: str) -> list[dict]:
    out = tmp_path / "rows.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", str(LAYERS), "--configs", "coda-fp8", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| coda-fp8 | folded whole |" in r.stdout
    return json.loads(out.read_text())


@pytest.mark.slow  # (two runs of a benchmark script in fresh processes: kept out of CI's 6 minutes)
def test_the_fp8_steps_launches_are_its_blocks(tmp_path: Path) -> None:
    import coda_lang
    from coda_lang.hf.blocks import model_source

    whole, unbatched, per_row = _rows(tmp_path)
    assert whole["whole_folds"] and whole["batched_folds"] and not unbatched["batched_folds"]
    assert not per_row["whole_folds"]
    from coda_lang.hf.state import block_wrt

    # the blocks as the patch makes them: the gate/up acc saved in e4m3 (hf.state's fp8_save, by
    # default), the backward reading it (fp8_acc)
    prog = coda_lang.load(model_source("bfloat16", 1e-5, 16, None, fp8="delayed", fp8_save=True))
    # call sites: the first block once, the layer block at each of the LAYERS - 1 boundaries, the last once
    sites = {"first_qkv": 1, "layer": LAYERS - 1, "last": 1}
    folds, gemms, batched, runs = 0, 0, 0, 0
    for name, n in sites.items():
        blk = prog[name]
        options = coda_lang.BackwardOptions(fp8_grads="e5m2", fp8_acc=True)
        bwd = blk.derivation(block_wrt(blk), backward=options).backward
        for cb in (blk.cuda(emulate=True), bwd.cuda(emulate=True)):
            folds += n * sum(len(v) for v in cb._whole.values())
            gemms += n * len(cb.gemm_stages)
            batched += n * len(cb._folds)  # (each an amax folded in the run's one _foreach_max)
            runs += n * bool(cb._folds)
    assert folds > 0 and batched > 0
    assert per_row["combine"] - whole["combine"] == folds
    assert unbatched["vector"] - whole["vector"] == batched and whole["folds"] == runs
    assert unbatched["total"] - whole["total"] == batched - runs
    assert whole["gemm"] - gemms == 3  # (the loss head's forward and backward GEMMs, one chunk)
    # the GEMM epilogues' K-major copies leave one transposing pass a block (the RoPE backward's, a
    # generated stage over column pairs), which $CODA_KMAJOR_STAGES=all takes too; without the
    # epilogues' copies ($CODA_KMAJOR_STORE=0) there are more
    assert whole["transposes"] == sum(sites.values())
    (wide, _, _) = _rows(tmp_path, CODA_KMAJOR_STAGES="all")
    assert wide["transposes"] == 0
    (passes, _, _) = _rows(tmp_path, CODA_KMAJOR_STORE="0")
    assert passes["transposes"] > whole["transposes"]
