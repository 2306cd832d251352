"""A picture of a checked block: its plan (plan.py) drawn as SVG, for `coda draw`.

What it does: `draw(plans)` lays out each block's plan and returns one SVG document. The stages and
the vector computations between them stand in a column in program order; each row of a stage's box
is one thing the plan says (its GEMM operands A and B, its accumulator, each load with its role, each
store with its dtype, each reduction with its combine rule, each tiling constraint). The block's
parameters stand in a column on the left, each beside the first row that reads it, with an arrow to
every row that reads it; the outputs stand on the right, with an arrow from the row that makes them.
A value that a stage stores or reduces, or that a vector computation makes, reaches the rows that
read it later through a vertical lane on the right of the column (one lane per arrow, nested ones
inside, so that they do not cross). Arrows are coloured by what makes the value (a parameter, a
stored tile, a reduction's partials, a vector computation) and drawn thick for a matrix, thin for a
vector, dashed for a scalar. Several blocks stand one below the other.
What it does not: check anything or decide what a stage loads or stores (check.py and the plan do),
or measure text: widths are estimated for a monospace font at 0.6 em per character.
Invariants: deterministic (the same plans give byte-identical text: every order is the program's, every
coordinate an integer); the text is well-formed XML and ASCII only (every other character is written
as a character reference), every name and expression escaped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coda_lang.frontend.syntax.printer import inline_source
from coda_lang.frontend.verify.plan import BlockPlan, StagePlan, explain
from coda_lang.frontend.verify.repeat import repeat_uses
from coda_lang.ir.nodes import Eqn, Stage, Var
from coda_lang.ir.types import Shape, Type, shape_str

FONT = 12  # px, monospace
CHAR = 0.6 * FONT  # estimated advance of one character
LINE = 20  # a row of a box
HEAD = 24  # a box's header
PAD = 8  # text inside a box, from its left edge
TAG = 7  # characters of the tag column (`reduce `)
GAP_IN = 110  # between the parameters' column and the stages'
LANE0 = 18  # from the widest box in the column to the first lane
LANE = 12  # between lanes
GAP_OUT = 56  # from the last lane to the outputs' column
MARGIN = 20
VGAP = 30  # between boxes of the column
SIDE_H = 20  # a parameter's or an output's box
SIDE_GAP = 6

# What makes a value: the colour of its arrows (and of its row's tag).
COLOURS = {"input": "#64748b", "store": "#15803d", "reduce": "#c2410c", "vector": "#7e22ce"}

STYLE = """
text { font-family: 'DejaVu Sans Mono', Menlo, Consolas, 'Liberation Mono', monospace; font-size: 12px; fill: #1e293b; }
.title { font-size: 14px; font-weight: bold; }
.head { font-weight: bold; }
.dim { fill: #64748b; }
.t-load { fill: #2563eb; } .t-store { fill: #15803d; }
.t-reduce { fill: #c2410c; } .t-vector { fill: #7e22ce; } .t-op { fill: #0f172a; font-weight: bold; }
.stage { fill: #ffffff; stroke: #334155; stroke-width: 1.2; }
.stage-head { fill: #e2e8f0; }
.vector { fill: #faf5ff; stroke: #7e22ce; stroke-width: 1.2; }
.vector-head { fill: #f3e8ff; }
.input { fill: #f1f5f9; stroke: #64748b; stroke-width: 1; }
.output { fill: #f0fdf4; stroke: #15803d; stroke-width: 1.2; }
.edge { fill: none; stroke-linejoin: round; }
"""


@dataclass
class _Row:
    tag: str  # "A", "B", "acc", "load", "store", "reduce", "tiling", or "" (a continuation, a vector line)
    text: str
    tag_class: str = "dim"
    bold: int = 0  # the first `bold` characters of the text (the value's name) are drawn bold
    defines: tuple[str, ...] = ()  # values this row makes (an arrow leaves from its right end)
    reads: tuple[str, ...] = ()  # values this row reads (an arrow arrives at its left or right end)


@dataclass
class _Box:
    kind: str  # "input" | "stage" | "vector" | "output"
    head: str  # bold header ("" for a parameter's or an output's one-row box)
    head_rest: str  # after it, not bold
    head_note: str  # right-aligned in the header
    rows: list[_Row]
    label: str  # what the box is, in words: `stage 2`, `parameter w_o`, `vector computation after ...`
    tooltip: str = ""
    x: int = 0
    y: int = 0
    w: int = 0

    @property
    def h(self) -> int:
        if not self.head:
            return SIDE_H
        return HEAD + LINE * len(self.rows) + 4

    def row_y(self, i: int) -> int:
        """The middle of row `i` (of the whole box, for a one-row box)."""
        if not self.head:
            return self.y + SIDE_H // 2
        return self.y + HEAD + LINE * i + LINE // 2

    @property
    def indent(self) -> int:
        """Characters before a row's text: the tag column of a stage."""
        return TAG if self.kind == "stage" else 0

    def text_width(self) -> int:
        head = len(self.head) + 2 + len(self.head_rest) + 3 + len(self.head_note) if self.head else 0
        chars = max([head] + [self.indent + len(r.text) for r in self.rows])
        return math.ceil(chars * CHAR) + 2 * PAD


@dataclass(frozen=True)
class _Edge:
    name: str  # the value it carries
    src: _Box
    src_row: int
    dst: _Box
    dst_row: int
    colour: str  # a key of COLOURS
    ndim: int  # 2: a matrix, 1: a vector, 0: a scalar


@dataclass
class _Panel:
    plan: BlockPlan
    title: str
    inputs: list[_Box] = field(default_factory=list)
    column: list[_Box] = field(default_factory=list)
    outputs: list[_Box] = field(default_factory=list)
    edges: list[_Edge] = field(default_factory=list)
    lanes: dict[int, int] = field(default_factory=dict)  # index in edges -> lane
    lane_x0: int = 0  # the first lane
    # Where an arrow meets its row, from the row's middle: by index in edges (arriving), by (id of the
    # box, row) (leaving).
    dy_in: dict[int, int] = field(default_factory=dict)
    dy_out: dict[tuple[int, int], int] = field(default_factory=dict)
    width: int = 0
    height: int = 0


def _type_text(t: Type | None) -> str:
    if t is None:
        return "?"
    return t.dtype + (shape_str(t.shape) if t.shape else "")


def _shape_text(dtype: str, shape: Shape) -> str:
    return dtype + (shape_str(shape) if shape else "")


def _vector_lines(eqns: tuple[Eqn, ...]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(text, names defined, names read) per line of `inline_source(eqns)`: the same folding of
    single-use temporaries, followed for the names."""
    texts = inline_source(eqns)
    uses: dict[str, int] = {}
    for e in eqns:
        for a in e.ins:
            if isinstance(a, Var):
                uses[a.name] = uses.get(a.name, 0) + 1
    folded: dict[str, list[str]] = {}
    groups: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for e in eqns:
        reads: list[str] = []
        for a in e.ins:
            if isinstance(a, Var):
                reads += folded.pop(a.name) if a.name in folded else [a.name]
        reads = list(dict.fromkeys(reads))
        if (
            len(e.outs) == 1
            and e.outs[0].name.startswith("_t")
            and uses.get(e.outs[0].name) == 1
            and not e.outs[0].annot
        ):
            folded[e.outs[0].name] = reads
        else:
            groups.append((tuple(o.name for o in e.outs), tuple(reads)))
    groups += [((name,), tuple(reads)) for name, reads in folded.items()]
    if len(groups) != len(texts):  # (the folding above is inline_source's: never, but draw the text anyway)
        return [(t, (), ()) for t in texts]
    return [(t, d, r) for t, (d, r) in zip(texts, groups, strict=True)]


def _stage_box(sp: StagePlan, st: Stage, types: dict[str, str], repeats: dict[str, list[str]]) -> _Box:
    rows: list[_Row] = []
    if st.is_gemm:
        for tag, atom, transposed in (("A", st.a, st.ta), ("B", st.b, st.tb)):
            name = atom.name if isinstance(atom, Var) else str(atom)
            text = f"{name}: {types.get(name, '?')}" + (", transposed" if transposed else "")
            rows.append(_Row(tag, text, "t-op", len(name), reads=(name,) if isinstance(atom, Var) else ()))
        rows.append(_Row("acc", f"f32{shape_str((sp.rows, sp.cols))}, K = {sp.k}", "dim"))
    else:
        rows.append(_Row("", f"tiles of a {shape_str((sp.rows, sp.cols))} matrix, no GEMM", "dim"))
    for ld in sp.loads:
        across = repeats.get(ld.name)
        again = f", repeated across `{'`, `'.join(across)}` columns" if across else ""
        text = f"{ld.name}: {_shape_text(ld.dtype, ld.shape)} {ld.role}{again}"
        rows.append(_Row("load", text, "t-load", len(ld.name), reads=(ld.name,)))
    for s in sp.stores:
        text = f"{s.name}: {_shape_text(s.dtype, s.shape)}"
        rows.append(_Row("store", text, "t-store", len(s.name), defines=(s.name,)))
    for r in sp.reductions:
        text = f"{r.name}: f32{shape_str(r.shape)} = {r.op} over {r.over}"
        rows.append(_Row("reduce", text, "t-reduce", len(r.name), defines=(r.name,)))
        if r.group:
            rows.append(_Row("", f"in groups of {r.group} (complete in its tile)", "dim"))
        else:
            per = "column tile" if r.axis == "columns" else "row tile"
            rows.append(_Row("", f"one partial per {per}, combined by {r.combine}", "dim"))
    for c in sp.constraints:
        rows.append(_Row("tiling", c, "dim"))
    if not (sp.loads or sp.stores or sp.reductions):
        rows.append(_Row("", "(the epilogue reads and writes nothing but acc)", "dim"))
    lines = [sp.text + " {"] + [f"  {t}" for t in inline_source(st.body)] + ["}"]
    label = f"stage {sp.index}"
    return _Box("stage", label, sp.text, f"line {sp.line}", rows, label, tooltip="\n".join(lines))


def _panel(plan: BlockPlan) -> _Panel:
    b = plan.block
    panel = _Panel(plan, explain(plan).split("\n")[0])
    types: dict[str, str] = {}  # value -> its text type, as stored (parameters, stores, reductions)
    ndims: dict[str, int] = {}
    made_by: dict[str, tuple[_Box, int, str]] = {}  # value -> (box, row, colour)

    for p in b.params:
        t = p.var.type
        text = f"{p.var.name}: {_type_text(t)}"
        if p.default is not None:
            text += f" = {p.default!r}" if isinstance(p.default, float) else f" = {p.default}"
        row = _Row("", text, bold=len(p.var.name), defines=(p.var.name,))
        box = _Box("input", "", "", "", [row], f"parameter {p.var.name}")
        panel.inputs.append(box)
        types[p.var.name] = _type_text(t)
        ndims[p.var.name] = len(t.shape) if t else 0
        made_by[p.var.name] = (box, 0, "input")

    repeats: dict[tuple[int, str], list[str]] = {}
    for u in repeat_uses(b):
        widths = repeats.setdefault((u.stage, u.name), [])
        if str(u.width) not in widths:
            widths.append(str(u.width))

    def connect(box: _Box) -> None:
        for i, row in enumerate(box.rows):
            for name in row.reads:
                src = made_by.get(name)
                if src is None or src[0] is box:
                    continue
                if any(e.dst is box and e.src is src[0] and e.src_row == src[1] for e in panel.edges):
                    continue  # one arrow per value into a box: to the first row that reads it
                panel.edges.append(_Edge(name, src[0], src[1], box, i, src[2], ndims.get(name, 1)))
            for name in row.defines:
                made_by[name] = (
                    box,
                    i,
                    {"t-store": "store", "t-reduce": "reduce"}.get(row.tag_class, "vector"),
                )

    def vector_box(eqns: tuple[Eqn, ...], where: str) -> _Box:
        rows = []
        for text, defines, reads in _vector_lines(eqns):
            rows.append(_Row("", text, "t-vector", max(text.find(" = "), 0), defines=defines, reads=reads))
        for e in eqns:
            for o in e.outs:
                ndims[o.name] = len(o.type.shape) if o.type else 1
                types[o.name] = _type_text(o.type)
        tooltip = "\n".join(r.text for r in rows)
        return _Box("vector", "vector computation", "", where, rows, f"vector computation {where}", tooltip)

    stages = b.stages
    n = len(plan.stages)
    for k, sp in enumerate(plan.stages):
        pre = plan.between[k] if k < len(plan.between) else ()
        if pre:
            box = vector_box(pre, "before stage 1" if k == 0 else f"between stages {k} and {k + 1}")
            connect(box)
            panel.column.append(box)
        box = _stage_box(sp, stages[k], types, {name: w for (s, name), w in repeats.items() if s == sp.index})
        connect(box)
        panel.column.append(box)
        for s in sp.stores:
            types[s.name], ndims[s.name] = _shape_text(s.dtype, s.shape), len(s.shape)
        for r in sp.reductions:
            types[r.name], ndims[r.name] = _shape_text("f32", r.shape), len(r.shape)
    post = plan.between[n] if len(plan.between) > n else ()
    if post:
        box = vector_box(post, "after the last stage")
        connect(box)
        panel.column.append(box)

    for o in b.outputs:
        row = _Row("", f"{o.name}: {_type_text(o.type)}", bold=len(o.name), reads=(o.name,))
        box = _Box("output", "", "", "", [row], f"output {o.name}")
        panel.outputs.append(box)
        connect(box)
    _layout(panel)
    return panel


def _stack(boxes: list[tuple[int, _Box]], top: int) -> int:
    """Place one-row boxes at the wanted middles, in order, none overlapping; the bottom reached."""
    bottom = top
    for want, box in boxes:
        box.y = max(want - SIDE_H // 2, bottom)
        bottom = box.y + SIDE_H + SIDE_GAP
    return bottom


def _spread(n: int, lo: int, hi: int) -> list[int]:
    """`n` offsets evenly from lo to hi (the middle for one)."""
    if n == 1:
        return [(lo + hi) // 2]
    return [lo + round(k * (hi - lo) / (n - 1)) for k in range(n)]


def _ports(panel: _Panel) -> None:
    """Where arrows meet a row: several arriving at one end of a row are spread over its height (the
    upper source, or the inner lane, higher, so that they do not cross); a row that arrows reach from
    the right and leave from the right takes them in above its middle and sends them out below."""
    ins: dict[tuple[int, int, bool], list[int]] = {}
    for i, e in enumerate(panel.edges):
        ins.setdefault((id(e.dst), e.dst_row, i in panel.lanes), []).append(i)
    for (box, row, right), group in ins.items():
        leaves = right and any(id(e.src) == box and e.src_row == row for e in panel.edges)
        if right:
            group.sort(key=lambda i: (panel.lanes[i], i))
        else:
            group.sort(key=lambda i: (panel.edges[i].src.row_y(panel.edges[i].src_row), i))
        for i, dy in zip(
            group, _spread(len(group), -8, -2) if leaves else _spread(len(group), -6, 6), strict=True
        ):
            panel.dy_in[i] = 0 if len(group) == 1 and not leaves else dy
        if leaves:
            panel.dy_out[(box, row)] = 6


def _layout(panel: _Panel) -> None:
    top = MARGIN + 26
    y = top
    for box in panel.column:
        box.y = y
        y += box.h + VGAP
    bottom = y - VGAP

    def first_reader(box: _Box) -> int:
        ys = [e.dst.row_y(e.dst_row) for e in panel.edges if e.src is box and e.dst.kind != "output"]
        return min(ys) if ys else bottom

    order = sorted(range(len(panel.inputs)), key=lambda i: (first_reader(panel.inputs[i]), i))
    bottom = max(bottom, _stack([(first_reader(panel.inputs[i]), panel.inputs[i]) for i in order], top))

    def maker(box: _Box) -> int:
        ys = [e.src.row_y(e.src_row) for e in panel.edges if e.dst is box]
        return ys[0] if ys else bottom

    order = sorted(range(len(panel.outputs)), key=lambda i: (maker(panel.outputs[i]), i))
    bottom = max(bottom, _stack([(maker(panel.outputs[i]), panel.outputs[i]) for i in order], top))

    # Lanes: an arrow between two boxes of the column runs down a lane on its right; shorter spans
    # take the inner lanes, so that nested arrows do not cross.
    inner = [
        i
        for i, e in enumerate(panel.edges)
        if e.src.kind in ("stage", "vector") and e.dst.kind in ("stage", "vector")
    ]
    spans = {
        i: (
            panel.edges[i].src.row_y(panel.edges[i].src_row),
            panel.edges[i].dst.row_y(panel.edges[i].dst_row),
        )
        for i in inner
    }
    taken: list[list[tuple[int, int]]] = []
    for i in sorted(inner, key=lambda i: (spans[i][1] - spans[i][0], spans[i][0], i)):
        lo, hi = spans[i]
        for lane, used in enumerate(taken):
            if all(hi + 14 < a or lo - 14 > b for a, b in used):  # (the ends move by up to 8: below)
                used.append((lo, hi))
                panel.lanes[i] = lane
                break
        else:
            taken.append([(lo, hi)])
            panel.lanes[i] = len(taken) - 1

    _ports(panel)
    x = MARGIN
    in_w = max([box.text_width() for box in panel.inputs], default=0)
    for box in panel.inputs:
        box.x, box.w = x, in_w
    x += in_w + GAP_IN if panel.inputs else 0
    stage_w = max([box.text_width() for box in panel.column if box.kind == "stage"], default=0)
    right = x
    for box in panel.column:
        box.x = x
        box.w = stage_w if box.kind == "stage" else max(box.text_width(), 200)
        right = max(right, box.x + box.w)
    panel.lane_x0 = right + LANE0
    x = right + LANE0 + LANE * max(len(taken) - 1, 0) + GAP_OUT
    out_w = max([box.text_width() for box in panel.outputs], default=0)
    for box in panel.outputs:
        box.x, box.w = x, out_w
    panel.width = x + out_w + MARGIN
    panel.height = bottom + MARGIN
    title_w = math.ceil(len(panel.title) * CHAR * 14 / 12) + 2 * MARGIN
    panel.width = max(panel.width, title_w)


def _esc(text: str) -> str:
    """Text for XML character data or an attribute value: markup escaped, ASCII only (a character that
    XML does not allow, a control character or a lone surrogate, as U+FFFD)."""
    out = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    return "".join(c if 32 <= ord(c) < 127 or c == "\n" else f"&#{_xml_char(c)};" for c in out)


def _xml_char(c: str) -> int:
    n = ord(c)
    allowed = n in (9, 10, 13) or 32 <= n < 0xD800 or 0xE000 <= n < 0xFFFE or n >= 0x10000
    return n if allowed else 0xFFFD


def _text(x: float, y: float, text: str, cls: str = "", bold: int = 0, anchor: str = "") -> str:
    attrs = f' class="{cls}"' if cls else ""
    attrs += f' text-anchor="{anchor}"' if anchor else ""
    body = _esc(text)
    if bold:
        body = f'<tspan class="head">{_esc(text[:bold])}</tspan>{_esc(text[bold:])}'
    return f'<text x="{round(x)}" y="{round(y)}"{attrs}>{body}</text>'


def _box_svg(box: _Box) -> list[str]:
    x, y, w, h = box.x, box.y, box.w, box.h
    out = ["<g>"]
    if box.tooltip:
        out.append(f"<title>{_esc(box.tooltip)}</title>")
    if not box.head:
        row = box.rows[0]
        out.append(f'<rect class="{box.kind}" x="{x}" y="{y}" width="{w}" height="{h}" rx="3"/>')
        out.append(_text(x + PAD, y + h // 2 + 4, row.text, bold=row.bold))
        out.append("</g>")
        return out
    r = 4
    out.append(f'<rect class="{box.kind}" x="{x}" y="{y}" width="{w}" height="{h}" rx="{r}"/>')
    band = f"M{x},{y + HEAD} V{y + r} Q{x},{y} {x + r},{y} H{x + w - r} Q{x + w},{y} {x + w},{y + r} V{y + HEAD} Z"
    out.append(f'<path class="{box.kind}-head" d="{band}"/>')
    out.append(f'<rect class="{box.kind}" x="{x}" y="{y}" width="{w}" height="{h}" rx="{r}" fill="none"/>')
    out.append(_text(x + PAD, y + 17, box.head, "head"))
    if box.head_rest:
        out.append(_text(x + PAD + (len(box.head) + 2) * CHAR, y + 17, box.head_rest))
    out.append(_text(x + w - PAD, y + 17, box.head_note, "dim", anchor="end"))
    for i, row in enumerate(box.rows):
        ty = box.row_y(i) + 4
        if row.tag:
            out.append(_text(x + PAD, ty, row.tag, row.tag_class))
        cls = "" if row.tag or box.kind == "vector" else row.tag_class
        out.append(_text(x + PAD + box.indent * CHAR, ty, row.text, cls, bold=row.bold))
    out.append("</g>")
    return out


def _edge_svg(panel: _Panel, i: int, e: _Edge) -> list[str]:
    src_left = e.src.kind == "input"
    sx, sy = e.src.x + e.src.w, e.src.row_y(e.src_row) + panel.dy_out.get((id(e.src), e.src_row), 0)
    if i in panel.lanes:  # down a lane on the right of the column, into the row's right end
        lx = panel.lane_x0 + LANE * panel.lanes[i]
        tx, ty, r = e.dst.x + e.dst.w, e.dst.row_y(e.dst_row) + panel.dy_in.get(i, 0), 5
        d = f"M{sx},{sy} H{lx - r} Q{lx},{sy} {lx},{sy + r} V{ty - r} Q{lx},{ty} {lx - r},{ty} H{tx}"
    elif e.dst.kind == "output" and not src_left:  # straight across the lanes, then a short curve
        tx, ty = e.dst.x, e.dst.row_y(0)
        bend = tx - GAP_OUT + 8
        d = f"M{sx},{sy} H{bend} C{bend + 20},{sy} {tx - 20},{ty} {tx},{ty}"
    else:  # from a parameter, into the row's left end
        tx, ty = e.dst.x, e.dst.row_y(e.dst_row) + panel.dy_in.get(i, 0)
        dx = (tx - sx) // 2
        d = f"M{sx},{sy} C{sx + dx},{sy} {tx - dx},{ty} {tx},{ty}"
    colour = COLOURS[e.colour]
    width = {2: "2.2", 1: "1.4"}.get(e.ndim, "1.2")
    dash = ' stroke-dasharray="4 3"' if e.ndim == 0 else ""
    return [
        f'<path class="edge" d="{d}" stroke="{colour}" stroke-width="{width}"{dash} marker-end="url(#to-{e.colour})"/>',
        f'<circle cx="{sx}" cy="{sy}" r="2.5" fill="{colour}"/>',
    ]


LEGEND = (
    ("input", 2, "parameter"),
    ("store", 2, "stored tile"),
    ("reduce", 1, "reduction: partials, complete after their stage"),
    ("vector", 1, "vector computation"),
)
WIDTHS = ((2, "matrix"), (1, "vector"), (0, "scalar"))


def _legend(y: int) -> tuple[list[str], int, int]:
    """The key, two lines: the colours (what makes a value), then the widths (its shape); the width and
    the height it takes."""
    out = ['<g class="legend">']
    width = 0
    for line, items in enumerate((LEGEND, tuple(("input", n, text) for n, text in WIDTHS))):
        x, ty = MARGIN, y + 20 * line
        for colour, ndim, label in items:
            stroke = {2: "2.2", 1: "1.4"}.get(ndim, "1.2")
            dash = ' stroke-dasharray="4 3"' if ndim == 0 else ""
            out.append(
                f'<path class="edge" d="M{x},{ty - 4} H{x + 28}" stroke="{COLOURS[colour]}" '
                f'stroke-width="{stroke}"{dash} marker-end="url(#to-{colour})"/>'
            )
            out.append(_text(x + 34, ty, label, "dim"))
            x += 34 + math.ceil(len(label) * CHAR) + 18
        if line == 1:
            note = "(hover over a stage for its epilogue)"
            out.append(_text(x + 6, ty, note, "dim"))
            x += 6 + math.ceil(len(note) * CHAR)
        width = max(width, x + MARGIN)
    out.append("</g>")
    return out, width, 40


def draw(plans: list[BlockPlan]) -> str:
    """One SVG document drawing each block's plan, one below the other (module docstring)."""
    panels = [_panel(plan) for plan in plans]
    legend, legend_w, legend_h = _legend(MARGIN + 10)
    width = max([legend_w] + [p.width for p in panels])
    body: list[str] = []
    top = MARGIN + legend_h
    for panel in panels:
        body.append(f'<g transform="translate(0,{top})">')
        body.append(_text(MARGIN, MARGIN + 4, panel.title, "title"))
        for box in panel.column + panel.inputs + panel.outputs:
            body += _box_svg(box)
        for i, e in enumerate(panel.edges):
            body += _edge_svg(panel, i, e)
        body.append("</g>")
        top += panel.height
    height = top
    names = ", ".join(p.plan.block.name for p in panels)
    markers = [
        f'<marker id="to-{key}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
        f'markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0 L10,5 L0,10 Z" fill="{colour}"/></marker>'
        for key, colour in COLOURS.items()
    ]
    head = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f"<title>{_esc('coda draw: ' + names)}</title>",
        f"<style>{STYLE}</style>",
        "<defs>",
        *markers,
        "</defs>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    return "\n".join(head + legend + body + ["</svg>"]) + "\n"
