#!/usr/bin/env python
"""`coda fuzz` on every block a patched Hugging Face model runs: each family's program as `coda_lang.hf`
writes it for bf16 and for each fp8 recipe, its layer blocks (`first_qkv`, `layer`, `last`) and its
loss and logits heads, fuzzed against the interpreter, forward and backward, with the backward options
the patch derives them with (the heads' chunks; `--fp8-grads e5m2`, and `--fp8-acc` where the gate/up
acc is saved in e4m3) and the parameters it differentiates (`hf.state.block_wrt`).

    python scripts/fuzz_hf_blocks.py --target cuda [--examples 6] [--jobs 8]      # on the GPU host
    python scripts/fuzz_hf_blocks.py --target emulate --families llama --blocks layer --examples 2
    python scripts/fuzz_hf_blocks.py --recipes delayed --list                       # the runs only
    python scripts/fuzz_hf_blocks.py --target emulate --kernel-plans --recipes delayed   # no GPU

A recipe is one of `RECIPES`: "bf16" (`apply_coda(model)`), "delayed" (the default of
`apply_coda(model, fp8="delayed")`: e5m2 cotangents, the gate/up acc saved in e4m3), "delayed-save16"
(the same with `CODA_FP8_SAVE_ACC=0`) and "delayed-forward" (cotangents in the model's dtype). The
heads (`HEADS`: "vocab" loss mode's `head_loss`, backward in chunks of the vocabulary; "rows" mode's
`head_loss_rows`, saved logits, backward in chunks of rows; `head_logits`) run under "bf16" only: an
fp8 model's heads are the same blocks, in the model's dtype, but for loss_mode="fp8"'s `head_loss_fp8`
(its GEMMs in fp8, e5m2 cotangents), which runs under "delayed" only. Families whose blocks are the same
program (Llama, Mistral, Ministral and Phi-3 differ only outside the blocks: attention windows,
weight layouts) are fuzzed once, under the first one's name, the others listed beside it. The
programs take each family's head_dim (`HEAD_DIMS`) and stand-ins for a model's other constants (4
query and 2 key/value heads, Granite's multipliers, a logit soft-cap of 30); `coda fuzz` runs them at
random sizes of the dims. Each run is `python -m coda_lang.cli fuzz FILE --block B ...` in a
subprocess, `--jobs` at a time; one line per run, then a summary. Exit status 0 when every run
passed, 1 when one failed (its output is printed), 2 for usage errors. `--keep DIR` writes the
programs there (else a temporary directory). `--kernel-plans` (with `--target emulate`): the emulated
kernels run the plans the GPU kernels get ($CODA_EMULATE_KERNEL_PLANS=1: the K-major copies, values
stored as their copy alone, the fp8 pairs as words), each stage's torch stand-in reading and writing
the layouts the kernel would: those plans checked against the interpreter without a GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from coda_lang.hf.family import Family

# recipe -> (apply_coda's fp8=, the gate/up acc saved in e4m3, coda fuzz's backward options of the layers);
# "delayed" keeps the out-projection in the model's dtype (a model patched under $CODA_FP8_OUT=0)
RECIPES: dict[str, tuple[str | None, bool, tuple[str, ...]]] = {
    "bf16": (None, False, ()),
    "delayed": ("delayed", True, ("--fp8-grads", "e5m2", "--fp8-acc")),
    "delayed-save16": ("delayed", False, ("--fp8-grads", "e5m2")),
    "delayed-forward": ("delayed-forward", False, ()),
    "blockwise": ("blockwise", False, ("--fp8-grads", "e5m2", "--requantize-wgrad")),
    # "delayed" with the out-projection in e4m3 too: the patch's default since 2026-11-29
    "delayed-out": ("delayed", True, ("--fp8-grads", "e5m2", "--fp8-acc")),
}
LAYERS = ("first_qkv", "layer", "last")
# the heads, with the backward options hf/state.py's `Blocks` makes them with (run under "bf16" only)
HEADS: dict[str, tuple[str, ...]] = {
    "head_loss": ("--chunk-dim", "V"),  # "vocab" loss mode: chunks of V within a byte budget
    "head_loss_rows": ("--remat", "save", "--chunk-dim", "M"),  # "rows" mode
    "head_logits": (),
}
# loss_mode="fp8"'s head (its GEMMs in fp8, e5m2 cotangents), in the programs of recipe "delayed" only
FP8_HEAD = "head_loss_fp8"
BLOCKS = LAYERS + tuple(HEADS) + (FP8_HEAD,)
# head_dim, by family, as the family's small released models have it (Qwen and OLMo 2 128, Gemma 2 and
# 3 256): the per-head q/k norm's groups and the RoPE pairs follow it. The families whose blocks are
# Llama's (Mistral, Ministral and Phi-3 differ outside them) run Llama-3.2-1B's 64 with it, as Granite
HEAD_DIMS = {"qwen3": 128, "qwen2": 128, "olmo2": 128, "gemma2": 256, "gemma3": 256}
HEAD_DIM = 64  # (the others)
N_HEADS = (4, 2)  # query and key/value heads
MULTIPLIERS = (12.0, 0.22, 8.0)  # Granite's (embedding, residual, logits), as its 2B config has them
SOFTCAP = 30.0


@dataclass(frozen=True)
class Run:
    families: tuple[str, ...]  # the first names the file; the others write the same program
    recipe: str
    block: str
    path: Path
    wrt: tuple[str, ...]
    flags: tuple[str, ...]  # coda fuzz's backward options

    @property
    def name(self) -> str:
        return f"{self.families[0]}/{self.recipe}/{self.block}"


def source(family: Family, recipe: str) -> str:
    """The program `coda_lang.hf` writes for a model of `family` under `recipe`, at the stand-in
    constants above (hf/state.py's `Blocks` passes a model's own)."""
    from coda_lang.hf.blocks import family_source

    fp8, save, _ = RECIPES[recipe]
    return family_source(
        family,
        "bfloat16",
        1e-6,
        HEAD_DIMS.get(family.name, HEAD_DIM),
        N_HEADS,
        MULTIPLIERS if family.multipliers else None,
        SOFTCAP if family.logit_softcap else None,
        fp8=fp8,
        fp8_save=save,
        fp8_head=recipe == "delayed",
        fp8_out=recipe == "delayed-out",
    )


def runs(families: list[str], recipes: list[str], blocks: list[str], out: Path) -> list[Run]:
    """One run per distinct program and block (the heads under "bf16" only): the programs written to
    `out`."""
    from coda_lang.api import load
    from coda_lang.hf.family import FAMILIES
    from coda_lang.hf.state import block_wrt

    got: list[Run] = []
    for recipe in recipes:
        texts: dict[str, list[str]] = {}
        for name in families:
            texts.setdefault(source(FAMILIES[name], recipe), []).append(name)
        for text, names in texts.items():
            path = out / f"{names[0]}-{recipe}.coda"
            path.write_text(text)
            prog = load(text)
            for block in blocks:
                if block in HEADS and recipe != "bf16":
                    continue  # (an fp8 model's heads are the bf16 model's)
                if block == FP8_HEAD and recipe != "delayed":
                    continue  # (loss_mode="fp8" takes fp8="delayed")
                flags = (
                    HEADS[block]
                    if block in HEADS
                    else ("--fp8-grads", "e5m2")
                    if block == FP8_HEAD
                    else RECIPES[recipe][2]
                )
                got.append(Run(tuple(names), recipe, block, path, tuple(block_wrt(prog[block])), flags))
    return got


def command(run: Run, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "coda_lang.cli", "fuzz", str(run.path), "--block", run.block]
    cmd += ["--target", args.target, "--examples", str(args.examples), "--seed", str(args.seed), "-q"]
    cmd += ["--wrt", ",".join(run.wrt), *run.flags]
    return cmd + (["--special"] if args.special else [])


def main(argv: list[str] | None = None) -> int:
    from coda_lang.hf.family import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=["cuda", "emulate", "interp"], default="cuda")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: every family)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated (default: every recipe)")
    p.add_argument("--blocks", default=",".join(BLOCKS), help="comma-separated (default: %(default)s)")
    p.add_argument("--examples", type=int, default=6, help="cases per block (default 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--special", action="store_true", help="inputs with special values too (coda fuzz --special)"
    )
    p.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--keep", metavar="DIR", default=None, help="write the programs here")
    p.add_argument(
        "--kernel-plans",
        action="store_true",
        help="with --target emulate: run the GPU kernels' plans on their torch stand-ins",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the runs' commands, run nothing (with --keep: the files they read)",
    )
    args = p.parse_args(argv)
    for what, plural, given, known in (
        ("family", "families", args.families, FAMILIES),
        ("recipe", "recipes", args.recipes, RECIPES),
        ("block", "blocks", args.blocks, BLOCKS),
    ):
        bad = [x for x in given.split(",") if x not in known]
        if bad:
            p.error(f"unknown {what} {bad[0]!r}; the {plural}: {', '.join(known)}")
    if args.examples < 1 or args.jobs < 1:
        p.error("--examples and --jobs must be at least 1")
    if args.kernel_plans and args.target != "emulate":
        p.error("--kernel-plans runs the kernels' plans on the emulated kernels: give --target emulate")

    with tempfile.TemporaryDirectory(prefix="coda-hf-blocks-") as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        todo = runs(args.families.split(","), args.recipes.split(","), args.blocks.split(","), out)
        if args.list:
            for r in todo:
                also = f"  (also {', '.join(r.families[1:])})" if len(r.families) > 1 else ""
                print(" ".join(command(r, args)) + also)
            if not args.keep:
                print("(the programs are in a temporary directory, removed now: --keep DIR keeps them)")
            return 0

        env = {**os.environ, "CODA_EMULATE_KERNEL_PLANS": "1"} if args.kernel_plans else None

        def one(r: Run) -> tuple[Run, int, str, str, float]:
            t = time.perf_counter()
            done = subprocess.run(command(r, args), capture_output=True, text=True, cwd=ROOT, env=env)
            return r, done.returncode, done.stdout, done.stderr, time.perf_counter() - t

        failed: list[tuple[Run, int, str]] = []
        start = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            for r, rc, out, err, secs in pool.map(one, todo):
                # (coda fuzz's verdict: its last line on stdout; stderr has the progress lines)
                lines = out.strip().splitlines() or err.strip().splitlines() or [""]
                text = out + err
                print(
                    f"{'ok  ' if rc == 0 else 'FAIL'} {r.name:36s} {secs:6.1f} s  {lines[-1][:120]}",
                    flush=True,
                )
                if rc != 0:
                    failed.append((r, rc, text))
        for r, rc, text in failed:
            print(f"\n== {r.name} (exit {rc}): {' '.join(command(r, args))}\n{text.strip()[-4000:]}")
        n = len(todo)
        print(
            f"\n{n - len(failed)} of {n} blocks passed (target {args.target}, {args.examples} cases "
            f"each{', special values' if args.special else ''}; {time.perf_counter() - start:.0f} s)"
        )
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
