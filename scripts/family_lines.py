"""The lines of .coda and of Python each model family of coda_lang.hf took: docs/models.md's table.

    python scripts/family_lines.py            # print the table
    python scripts/family_lines.py --show F   # print the Python lines counted for family F
    python scripts/family_lines.py --write    # put the table into docs/models.md

.coda: each family's program is `coda_lang.hf.blocks.model_source(...)` for its facts (one
parameterised source); its lines are counted without blank and comment lines, and a family's own
are the lines of its program that are not in Llama's (difflib: new or changed lines).

Python: the code lines of coda_lang/hf/*.py (no blank lines, comments or docstrings; the .coda
templates of blocks.py are .coda, not Python), and the lines of coda_lang/torch.py (whose LLaMA MLP
stages the blocks share) that name a family's markers. A family's lines are those of the definitions and
modules named for it in `PARTS`, and every statement elsewhere that names one of its markers (a
name, an attribute, an imported name, a parameter or a string equal to a marker: its Family
constant, its entry point, the facts it brought, their helpers): the lines naming one, a definition
named by one or a compound statement (if, for, with) whose header names one whole. Each line counts
once, for the first part (in `PARTS`' order) that names it; Llama's row is the rest: the patch every
family shares.
The markers are written here by hand; what they select is counted by the script, and
`--show` prints it for review.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "coda_lang" / "hf"
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- generated:family-lines -->", "<!-- end:family-lines -->"
# outside coda_lang/hf, searched for the families' markers only (not part of the shared patch's count):
# coda_lang.torch's LLaMA MLP stages, which the hf blocks share
ALSO = (ROOT / "coda_lang" / "torch.py",)


@dataclass(frozen=True)
class Part:
    """What of coda_lang/hf is one family's (or families'): `modules` whole, and the statements that
    name a marker."""

    label: str  # the table's row
    families: tuple[str, ...]  # their names (`Family.name`) in coda_lang.hf.family.FAMILIES
    markers: frozenset[str] = field(default_factory=frozenset)
    modules: tuple[str, ...] = ()


PARTS = (
    Part(
        "Qwen3: per-head q/k norm",
        ("qwen3",),
        frozenset(
            {"QWEN3", "apply_coda_to_qwen3", "qk_norm", "qk_norm_weights", "q_norm", "k_norm", "gq", "gk"}
        ),
    ),
    Part(
        "Mistral, Ministral: sliding windows",
        ("mistral", "ministral"),
        frozenset(
            {
                "MISTRAL",
                "MINISTRAL",
                "apply_coda_to_mistral",
                "apply_coda_to_ministral",
                "sliding",
                "layer_masks",
                "window",
                "check_layer_kinds",
            }
        ),
        ("masks.py",),
    ),
    Part(
        "Qwen2: QKV bias",
        ("qwen2",),
        frozenset(
            {
                "QWEN2",
                "apply_coda_to_qwen2",
                "qkv_bias",
                "fused_bias",
                "QKV_PROJ",
                "b_qkv",
                "bias",
                "qkv_inputs",
            }
        ),
    ),
    Part(
        "Granite: multipliers",
        ("granite",),
        frozenset(
            {
                "GRANITE",
                "apply_coda_to_granite",
                "multipliers",
                "residual",
                "logit_scale",
                "embedding_multiplier",
                "residual_multiplier",
                "logits_scaling",
                "attention_multiplier",
            }
        ),
    ),
    Part(
        "Phi-3: fused checkpoint projections, residual dropout",
        ("phi3",),
        frozenset(
            {
                "PHI3",
                "apply_coda_to_phi3",
                "qkv_parts",
                "gate_up_parts",
                "act_name",
                "resid_dropouts",
                "qkv_fused",
                "qkv_unfused",
                "gate_up_fused",
                "gate_up_unfused",
                "_coda_names",
                "brace",
                "ROPE_WHY",
            }
        ),
    ),
    Part(
        "OLMo 2: post norms, q/k norm over each projection",
        ("olmo2",),
        frozenset(
            {
                "OLMO2",
                "apply_coda_to_olmo2",
                "pre_norm",
                "post_norm",
                "layer_norms",
                "norm_names",
                "post_feedforward_layernorm",
                "pre_feedforward_layernorm",
                "qk_proj_norm_weights",
                "_QKV_PROJ_NORM",
                "gqk",
                "go",
                "gd",
            }
        ),
    ),
    Part(
        "Gemma 2: norms of 1 + w, GeGLU, scaled embeddings, soft-capping",
        ("gemma2",),
        frozenset(
            {
                "GEMMA2",
                "apply_coda_to_gemma2",
                "norm_offset",
                "_weight",
                "activation",
                "act_config",
                "ACTIVATIONS",
                "act",
                "scaled_embedding",
                "embed_scale",
                "logit_softcap",
                "softcap",
                "_logits",
                "attn_softcap",
                "attn_logit_softcapping",
                "final_logit_softcapping",
                "hidden_activation",
                "query_pre_attn_scalar",
                "use_bidirectional_attention",
                "eps_attr",
                "eager",
            }
        ),
    ),
    Part(
        "Gemma 3: per-head q/k norm of heads wider than a tile, a RoPE per kind of layer",
        ("gemma3",),
        frozenset(
            {
                "GEMMA3",
                "apply_coda_to_gemma3",
                "config_type",
                "base_class",
                "NOT_FAMILIES",
                "heads_fit_tiles",
                "CANDIDATES",
                "rope_kinds",
                "rope_tables",
                "freqs",
            }
        ),
    ),
)


def code_lines(src: str, tree: ast.Module, coda_names: frozenset[str]) -> set[int]:
    """The lines of `src` holding code: no blank or comment-only lines, no docstrings, no module-level
    string constants named in `coda_names` (.coda templates)."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        skip = (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        )
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            lines -= _span(body[0])
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        named = any(isinstance(t, ast.Name) and t.id in coda_names for t in node.targets)
        if named and isinstance(node.value, ast.Constant):
            lines -= _span(node)
    lines.discard(0)
    return lines


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _span(node: ast.AST) -> set[int]:
    return set(range(node.lineno, (node.end_lineno or node.lineno) + 1))  # type: ignore[attr-defined]


def _hits(node: ast.AST, markers: frozenset[str]) -> set[int]:
    """The lines in `node` of a name, attribute, imported name, parameter, string (or a definition's
    name) equal to a marker. (A keyword's name is not one: `bias=False` names no bias of a family.)"""
    out: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            name = n.id
        elif isinstance(n, ast.Attribute):
            name = n.attr
        elif isinstance(n, ast.alias):
            name = n.asname or n.name
        elif isinstance(n, ast.arg):
            name = n.arg
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            name = n.value
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = n.name
        else:
            continue
        if name in markers:
            out.add(getattr(n, "lineno", 0) or node.lineno)  # type: ignore[attr-defined]
    return out


def _header(node: ast.stmt) -> list[ast.AST]:
    """The parts of a compound statement before its body."""
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.target, node.iter]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return list(node.items)
    return []


def _marked(stmts: list[ast.stmt], markers: frozenset[str]) -> set[int]:
    """Lines of the statements that name a marker (see the module docstring): a definition named by
    one, or a compound statement whose header names one, whole; elsewhere the lines naming one."""
    out: set[int] = set()
    for node in stmts:
        bodies = [
            b for b in ("body", "orelse", "finalbody", "handlers") if isinstance(getattr(node, b, None), list)
        ]
        if not bodies:
            out |= _hits(node, markers)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in markers:
                out |= _span(node)
                continue
            if not isinstance(node, ast.ClassDef):
                out |= _hits(node.args, markers)  # a parameter of its own
        elif any(_hits(h, markers) for h in _header(node)):
            out |= _span(node)
            continue
        for b in bodies:
            inner = getattr(node, b)
            if b == "handlers":
                for h in inner:
                    out |= _marked(h.body, markers)
            else:
                out |= _marked(inner, markers)
    return out


@dataclass
class Counts:
    coda: dict[str, tuple[int, int]]  # family: (its program's lines, lines beyond Llama's)
    python: dict[str, int]  # part label: lines; "" the shared rest
    shown: dict[str, list[str]]  # part label: the lines counted, "file:line: text"


def count() -> Counts:
    sys.path.insert(0, str(ROOT))
    from coda_lang.hf.blocks import model_source
    from coda_lang.hf.family import FAMILIES

    by_name = {f.name: f for f in FAMILIES.values()}

    def program(fam: str) -> list[str]:
        f = by_name[fam]
        scales = (2.0, 0.5, 4.0) if f.multipliers else None  # (any values: the text is the same)
        text = model_source(
            "bfloat16",
            1e-6,
            256 if f.rope_kinds else 128,  # (Gemma 3's heads: 256 columns, as its released models')
            f.qk_norm,
            f.qkv_bias,
            scales,
            pre_norm=f.pre_norm,
            post_norm=f.post_norm,
            heads=(16, 8),  # (any heads: the text is the same but for their widths' values)
            norm_offset=f.norm_offset,
            act=f.activation,
            softcap=30.0 if f.logit_softcap else None,  # (Gemma 2's; Gemma 3's is off by default)
        )
        return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]

    base = program("llama")
    coda = {"llama": (len(base), len(base))}
    for fam in by_name:
        if fam != "llama":
            lines = program(fam)
            diff = difflib.ndiff(base, lines)
            coda[fam] = (len(lines), sum(1 for d in diff if d.startswith("+ ")))
    python: dict[str, int] = {}
    shown: dict[str, list[str]] = {}
    everything: dict[str, set[int]] = {}
    hf_files = {p.name for p in HF.glob("*.py")}
    claimed: dict[str, set[int]] = {}
    for path in [*sorted(HF.glob("*.py")), *ALSO]:
        src = path.read_text()
        tree = ast.parse(src)
        coda_names = (
            frozenset(
                {
                    "_QKV",
                    "_QKV_NORM",
                    "_QKV_NORM_ROWS",
                    "_QKV_PROJ_NORM",
                    "_POST_NORM_STAGES",
                    "_TEMPLATE",
                    "_INPUT_NORM",
                    "_THEN",
                }
            )
            if path.name == "blocks.py"
            else frozenset()
        )
        code = code_lines(src, tree, coda_names)
        everything[path.name] = code
        text = src.splitlines()
        for part in PARTS:  # each line counted once: for the first part that names it
            got = set(code) if path.name in part.modules else _marked(tree.body, part.markers) & code
            got -= claimed.get(path.name, set())
            python[part.label] = python.get(part.label, 0) + len(got)
            shown.setdefault(part.label, []).extend(f"{path.name}:{n}: {text[n - 1]}" for n in sorted(got))
            claimed.setdefault(path.name, set()).update(got)
    python[""] = sum(len(everything[f] - claimed.get(f, set())) for f in everything if f in hf_files)
    return Counts(coda, python, shown)


def table(c: Counts) -> str:
    from coda_lang.hf.family import FAMILIES  # (count() put the project on the path)

    rows = [
        "| family | .coda: its program's lines | .coda: lines beyond Llama's | Python: lines beyond the shared patch |",
        "|---|---|---|---|",
        f"| Llama (the shared patch) | {c.coda['llama'][0]} | (all) | {c.python['']} (all of coda_lang/hf but the rows below) |",
    ]
    names = {f.name for f in FAMILIES.values()}
    for part in PARTS:
        fams = [f for f in part.families if f in names]
        progs = ", ".join(f"{c.coda[f][0]}" for f in fams)
        beyond = ", ".join(f"{c.coda[f][1]}" for f in fams)
        rows.append(f"| {part.label} | {progs} | {beyond} | {c.python[part.label]} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="put the table into docs/models.md")
    ap.add_argument(
        "--show", metavar="LABEL", help="print the Python lines of the part whose label starts so"
    )
    args = ap.parse_args()
    c = count()
    if args.show:
        for label, lines in c.shown.items():
            if label.lower().startswith(args.show.lower()):
                print("\n".join(lines))
        return 0
    t = table(c)
    if not args.write:
        print(t, end="")
        return 0
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        print(f"{DOC}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{t}{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
