"""How many launches a patched model's training step issues, by kind, counted on the CPU.

Usage: python benchmarks/launch_count.py [--layers 16] [--configs coda,coda-fp8,coda-fp8-blockwise] [--json FILE]

The host's time per launch is what bounds a synchronized fp8 step on one GPU (benchmarks/RESULTS.md),
so the number of launches is worth tracking where no GPU is at hand. This builds a Llama of
Llama-3.2-1B's structure (`--layers` decoder layers, tied embeddings, 4:1 grouped-query heads) at tiny
widths: what the runtime launches does not depend on the widths. It runs two training steps on the
CPU, through the kernels' torch stand-ins (the path CI runs), and counts, in the second step, the
runtime's launch points, which are the GPU run's:
- `gemm`: GEMM stage launches (`StageRunner.call`, each one quack kernel on a GPU);
- `elementwise`: elementwise stages (`ElementwiseStage.run`, each one generated Triton kernel);
- `vector`: vector equations between stages (`VectorStep`, each one torch op; `detach` and `copy`,
  which give their operand back, not counted);
- `combine`: a GEMM sink's per-tile partials combined (one torch op each);
- `transposes`: the K-major copies the runtime makes in a pass of their own (fp8 backward GEMMs),
  counted from the blocks' plans: what `launch.kmajor_pair` copies on a GPU, with the copies the
  producing stages write (`TritonStage.kmajor_stores`, `$CODA_KMAJOR_STAGES`; torch.compile's stages
  under `$CODA_KMAJOR_INDUCTOR=1`, `InductorStage.kmajor_stores`; a GEMM epilogue's `Output.kmajor`,
  `$CODA_KMAJOR_STORE`) taken away.
Each row is also given without `cuda_block.whole_folds` (the sink partials folded whole), in the
same process. Attention and the optimizer are not counted (theirs are the same in every row).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))


# each configuration's fp8 recipe
RECIPES = {"coda": None, "coda-fp8": "delayed", "coda-fp8-blockwise": "blockwise"}


def build(config: str, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from coda_lang.hf import apply_coda

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        # (coda-fp8-blockwise: 2:1 grouped-query heads, so that the fused QKV width, (8 + 2 x 4) x 16, is
        # whole groups of 128, as fp8="blockwise" needs; what is launched does not depend on it)
        num_key_value_heads=4 if config == "coda-fp8-blockwise" else 2,
        head_dim=16,
        num_hidden_layers=layers,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return apply_coda(model, fp8=RECIPES[config])


def transposes(model: Any) -> int:
    """K-major copies the runtime makes in a pass of its own in one step (from the blocks' plans)."""
    from coda_lang.backend_triton.elementwise import InductorStage
    from coda_lang.backend_triton.generate import TritonStage

    st = model._coda
    b = st.blocks(torch.bfloat16)
    n_layers = len(model.model.layers)
    per_block: dict[str, int] = {}
    for fn in (b.first, b.layer, b.last):
        bwd = fn.kernel_blocks()[1]
        made = set()
        for es in bwd.elementwise.values():
            stage = TritonStage(es) if es.generator == "triton" else InductorStage(es, compiled=False)
            marks = stage.kmajor_stores(bwd._kmajor)
            made |= {n for (n, _d, _w), on in zip(es.store_meta, marks, strict=True) if on}
        for spec in bwd.specs:
            if spec is not None and spec.d is not None and spec.d.narrow and spec.d.name in bwd._kmajor:
                made.add(spec.d.name)  # (the narrowing pass writes it: layouts.narrowed_with_kmajor)
            if spec is not None:  # (a GEMM epilogue stores it: spec.Output.kmajor)
                made |= {o.name for o in spec.outputs if o.kmajor}
        per_block[fn.name] = len(bwd._kmajor - made)
    # (the first block, then one layer block per boundary between layers, then the last layer's)
    return per_block[b.first.name] + (n_layers - 1) * per_block[b.layer.name] + per_block[b.last.name]


def count(model: Any, whole: bool, batched: bool = True) -> dict[str, int]:
    from coda_lang.backend_cute.runtime import cuda_block, launch, vector_eqn
    from coda_lang.backend_triton import elementwise

    with warnings.catch_warnings():  # (isinstance on every live object wakes torch's deprecated aliases)
        warnings.simplefilter("ignore")
        blocks = [o for o in gc.get_objects() if isinstance(o, cuda_block.CudaBlock)]
    saved = {id(c): (c._whole, c._folds, c._after) for c in blocks}
    for c in blocks:
        if not whole:
            c._whole = {}
        if not whole or not batched:  # (the batched folds are of whole sinks or vectors)
            c._folds, c._after = {}, frozenset()
    n: collections.Counter[str] = collections.Counter()
    undo = []

    def wrap(owner: Any, attr: str, label: str, when: Any = None) -> None:
        f = getattr(owner, attr)

        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            if when is None or when(*a):
                n[label] += 1
            return f(*a, **k)

        setattr(owner, attr, g)
        undo.append((owner, attr, f))

    wrap(launch.StageRunner, "call", "gemm")
    wrap(elementwise.ElementwiseStage, "run", "elementwise")
    # (`detach` and `copy` give their operand back: no launch)
    wrap(vector_eqn.VectorStep, "__call__", "vector", lambda s, *a: s.eqn.op not in ("detach", "copy"))
    wrap(launch, "combine_rule", "combine")
    # a block run's amax folds together (cuda_block.batched_folds): one call, two kernels on a GPU
    wrap(torch, "_foreach_max", "folds")
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for owner, attr, f in undo:
            setattr(owner, attr, f)
        for c in blocks:
            c._whole, c._folds, c._after = saved[id(c)]
    return dict(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--configs", default="coda,coda-fp8")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for config in args.configs.split(","):
        if config not in RECIPES:
            p.error(f"--configs: {', '.join(RECIPES)}, got {config!r}")
        model = build(config, args.layers)
        ids = torch.randint(0, 256, (1, 64))
        t = time.perf_counter()
        for _ in range(2):  # (the first step calibrates the fp8 scales: it runs blocks twice)
            model(input_ids=ids, labels=ids).loss.backward()
        print(f"{config}: two warm-up steps {time.perf_counter() - t:.1f} s", file=sys.stderr)
        t_copy = transposes(model)
        for whole, batched in ((True, True), (True, False), (False, False)):
            c = count(model, whole, batched)
            c["transposes"] = t_copy
            kinds = ("gemm", "elementwise", "vector", "folds", "combine", "transposes")
            c["total"] = sum(c.get(k, 0) for k in kinds)
            rows.append(
                {"config": config, "whole_folds": whole, "batched_folds": batched, "layers": args.layers, **c}
            )
    print(f"\nlaunches in one training step, {args.layers} layers (attention and the optimizer not counted)")
    print(
        "| config | sink partials | amax folds | gemm | elementwise | vector | folds | combine | transposes | total |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {'folded whole' if r['whole_folds'] else 'combined per row'} "
            f"| {'batched' if r['batched_folds'] else 'each in place'} | {r.get('gemm', 0)} "
            f"| {r.get('elementwise', 0)} | {r.get('vector', 0)} | {r.get('folds', 0)} | {r.get('combine', 0)} "
            f"| {r['transposes']} | {r['total']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
