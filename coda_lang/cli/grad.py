"""`coda grad`: derive the backward block and print it as .coda source."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    load_block,
    parse_backward,
    read_source_file,
    usage_error,
    write_text,
)
from coda_lang.core.diagnostics import CodaError, render_all
from coda_lang.frontend.syntax.printer import dims_source, print_block


def add_parser(sub: Any) -> None:
    g = sub.add_parser(
        "grad",
        help="derive the backward block (printed as .coda source)",
        description="Derive the backward block of a block by reverse-mode autodiff and print it as "
        ".coda source (which `coda check` accepts). The VJP of each stage's epilogue runs in the "
        "epilogue of the GEMM that produces its cotangent; where none does (the block's entry), "
        "in one elementwise stage, which is reported. The printed block says which forward "
        "tensors it reads (saved).",
    )
    g.add_argument("file", metavar="FILE")
    g.add_argument(
        "--block", metavar="NAME", help="the block to differentiate (needed when the file has several)"
    )
    g.add_argument(
        "--wrt",
        metavar="P,Q",
        help="parameters to differentiate with respect to (default: every float parameter without a default)",
    )
    g.add_argument(
        "--with-forward",
        action="store_true",
        help="also print the forward block, extended to store the saved tensors",
    )
    g.add_argument(
        "-o", "--output", metavar="OUT.coda", help="write here instead of standard output (atomically)"
    )
    g.add_argument(
        "--remat",
        metavar="POLICY",
        help="the saved-tensor policy: auto (default: stored tiles are recomputed in an epilogue the "
        "backward runs anyway where that holds fewer bytes, and a GEMM runs again only for a stage that "
        "stores no tile, such as a loss head, whose [M, V] logits are then never kept), save (the "
        "backward reads every tile the forward keeps), recompute (as auto, and the GEMM of every stage "
        "at the block's entry runs again in the backward, its epilogue computing the stage's backward "
        "from the f32 acc), rebuild (as save, except tiles an elementwise stage at the backward's start "
        "can make again bit for bit from what the backward holds, such as the fp8 copy of a saved tile). "
        'remat="..." on a gemm stage overrides it for that stage. The printed header '
        "lists each saved tensor with its bytes per row and says why each value is recomputed",
    )
    g.add_argument(
        "--fp8-grads",
        choices=("e5m2", "e4m3"),
        help="quantize the cotangent (dacc) of each GEMM stage with an fp8 operand to this dtype before "
        "its dgrad and wgrad GEMMs (straight-through, scaled and saturating as the forward's stores), "
        "with a delayed per-tensor scale: the backward takes `dacc<k>_scale: f32` as an input, "
        "multiplies the GEMMs' acc by its inverse, and returns this step's amax of the cotangent as "
        '`dacc<k>_amax` (docs/design.md, "The fp8 backward"). A backward GEMM of such a cotangent and '
        "an operand not stored in fp8 is refused (E0602)",
    )
    g.add_argument(
        "--fp8-acc",
        action="store_true",
        help="where a GEMM stage stores a scaled fp8 copy of its acc itself (`q: e4m3 = acc * s`, s a "
        "scalar or a vector over the rows), read acc in the backward as that copy times 1/s instead of saving a copy in the "
        "activation dtype: half the bytes or less, the acc the backward sees rounded to fp8 "
        '(BackwardOptions(fp8_acc=True); docs/design.md, "Saving activations in fp8")',
    )
    g.add_argument(
        "--requantize-wgrad",
        action="store_true",
        help="a block-scaled GEMM's weight gradient reads its activation quantized again in g x 1 groups "
        "(a scale per g rows and column, made by an elementwise stage of the backward) instead of the "
        "forward's 1 x g codes, whose scales change along its contraction: DeepSeek-V3's recipe "
        '(BackwardOptions(requantize_wgrad=True); docs/design.md, "Block scales")',
    )
    g.add_argument("--error-format", choices=("human", "short"), default="human")
    g.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    block, code = load_block(args.file, args.block, args.error_format)
    if block is None:
        return code

    assert isinstance(block, Block)
    options = parse_backward(args.remat)
    if not isinstance(options, BackwardOptions):
        return options
    options = options.with_(
        fp8_grads=args.fp8_grads, fp8_acc=args.fp8_acc, requantize_wgrad=args.requantize_wgrad
    )
    wrt = [w.strip() for w in args.wrt.split(",") if w.strip()] if args.wrt else None
    try:
        d = block.derivation(wrt, backward=options)
    except ValueError as e:  # --wrt naming no parameter of the block
        return usage_error(str(e).replace("wrt= names", "--wrt names"))
    except CodaError as e:
        text = read_source_file(args.file) or ""
        print(render_all(e.diagnostics, {args.file: text}, args.error_format), file=sys.stderr)
        return EXIT_ERRORS
    parts = []
    dims = d.forward.ir.dims if args.with_forward else d.backward.ir.dims  # the forward's are a superset
    if dims:
        parts.append(dims_source(dims) + "\n")
    if args.with_forward:
        parts.append(print_block(d.forward.ir, with_dims=False))
    parts.append(print_block(d.backward.ir, with_dims=False))
    text = "\n".join(parts)
    # the notes are `# note:` comments of the printed source too: on a terminal, once is enough
    if args.output or not sys.stdout.isatty():
        for line in d.report:
            print(f"note: {line}", file=sys.stderr)
    if args.output:
        try:
            write_text(args.output, text)
        except OSError as e:
            return usage_error(f"can't write {args.output}: {e.strerror or e}")
        print(
            f"wrote {args.output}: {d.backward.name} ({len(d.backward.plan.stages)} stages)", file=sys.stderr
        )
    else:
        sys.stdout.write(text)
    return EXIT_OK
