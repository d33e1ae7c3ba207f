"""``refusion trace``: decode one prompt with several decoders and draw, iteration by iteration, what each did.

Each decoder runs on the model and with the settings the bench config (``configs/bench/bench.yaml``) gives it
for ``--task``; the prompt is that task's sample ``--idx`` or ``--prompt``. Every decode becomes a
:class:`Lane`: the generation span as one cell per position (its token, the iteration that committed
it, whether the output keeps it) and one :class:`Step` per iteration, read from the decoder's
per-iteration trace (:class:`~refusion.core.types.IterationTrace`): the slots scored in Stage I with
their scores, the chosen ones, what was accepted, ReFusion's Stage II-b rounds, remasked suffixes and
split tails. The trace records slot starts only; a ReFusion slot's size is rebuilt from the slot grid
(:func:`slot_sizes`). Token-level decoders (``llada``, ``block``, ``ar``) score and commit single
positions.

:func:`build_html` writes one self-contained page (inline CSS and JS, no network) with the lanes side by
side, a shared iteration slider, step and play buttons, each lane's per-iteration details and its final
text; :func:`build_svg` writes an animated SVG (CSS keyframes, no script) of the output's cells filling
in, one iteration per beat, for the README. docs/trace.md says how to read both.

Why one module of about 560 lines: the lanes read from the traces, the SVG drawing and the command share
the :class:`Lane` / :class:`Step` layout (geometry and colours) that only this view uses.
"""

from __future__ import annotations

import argparse
import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from refusion.core.config import ConfigError
from refusion.core.types import DecodeResult, IterationTrace
from refusion.experiments.args import add_bench_config_args, add_machine_args, add_split_arg
from refusion.models.loading import RuntimeOptions, runtime_from_args


@dataclass
class Cell:
    """One position of the generation span."""

    piece: str  # the token's text ("" when never committed); an EOS shows as "<eos>"
    at: int  # the iteration (1-based) that committed it; 0: never committed
    kept: bool  # in the output (False: never committed, or committed after the EOS and cut)
    eos: bool = False  # the token is an EOS (its piece is no part of the text)


@dataclass
class Step:
    """One iteration, positions as offsets from the start of the generation span."""

    block: int
    stage: str  # II-a / II-b (ReFusion), mdm (llada), block, ar
    forwards: int
    rounds: int  # Stage II-b rounds (0 elsewhere)
    fused: bool  # Stage I's logits came from the previous iteration's verification forward
    slots: list[tuple[int, int, float]]  # (offset, size, score) of every slot scored in Stage I, in position order
    chosen: list[tuple[int, int]]  # (offset, size) of the chosen slots (sizes before any split)
    accepted: list[tuple[int, int]]  # (offset, tokens committed from it)
    remasked: list[tuple[int, int]] = field(default_factory=list)  # (offset, size) sent back to the pool
    split: list[tuple[int, int]] = field(default_factory=list)  # (offset, size) of tails split off chosen slots

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.accepted)


@dataclass
class Lane:
    """One decoder's decode of the prompt, ready to draw."""

    label: str  # the decoder's name in the bench config
    model: str
    config: dict[str, Any]  # the full decoder config
    prompt_len: int  # position of the span's first cell
    cells: list[Cell]
    steps: list[Step]
    text: str  # the decoded output
    stats: dict[str, Any]  # DecodeStats.as_dict()


def slot_sizes(trace: Sequence[IterationTrace], prompt_len: int, slot_size: int | None) -> list[dict[int, int]]:
    """Per iteration, ``{slot start: size}`` of every slot scored or chosen in it (sizes before any split).

    ``slot_size`` None: every slot is one position (token-level decoders). Else a ReFusion pool slot is a
    run of still-masked positions inside one cell of the slot grid (cells of ``slot_size`` from
    ``prompt_len``), ending before the next slot start (a slot scored in this iteration, or a split tail
    or remasked suffix of an earlier one), the next position committed in an earlier iteration, or the
    grid cell's end; the decoder never merges pool slots, so these are the decoder's own slots."""
    out: list[dict[int, int]] = []
    committed: set[int] = set()
    starts: set[int] = set()  # slot starts off the grid: split tails and remasked suffixes so far
    for it in trace:
        these = {s for s, _ in it.scored} | set(it.chosen)
        if slot_size is None:
            out.append({s: 1 for s in these})
        else:
            bounds = starts | these
            sizes = {}
            for s in these:
                end = prompt_len + ((s - prompt_len) // slot_size + 1) * slot_size
                p = s + 1
                while p < end and p not in bounds and p not in committed:
                    p += 1
                sizes[s] = p - s
            out.append(sizes)
        committed.update(p for s, n in it.accepted for p in range(s, s + n))
        starts.update(s for s, _ in it.split)
        starts.update(s for s, _ in it.remasked)
    return out


def build_lane(label: str, model: str, config: dict[str, Any], result: DecodeResult, tokenizer: Any,
               prompt_len: int, eos_ids: set[int], slot_size: int | None = None) -> Lane:
    """A :class:`Lane` from one decode. ``slot_size``: the ReFusion slot grid (None: token-level decoder).
    The span runs from ``prompt_len`` to the last position the trace or the output touches; a committed
    token's piece comes from the decode's buffer (``result.buffer_ids`` at ``result.buffer_pos``)."""
    sizes = slot_sizes(result.trace, prompt_len, slot_size)
    steps = []
    for it, size in zip(result.trace, sizes):
        steps.append(Step(
            block=it.block, stage=it.stage, forwards=it.forwards, rounds=it.rounds, fused=it.fused,
            slots=sorted((s - prompt_len, size[s], float(x)) for s, x in it.scored),
            chosen=sorted((s - prompt_len, size[s]) for s in it.chosen),
            accepted=[(s - prompt_len, n) for s, n in it.accepted],
            remasked=[(s - prompt_len, n) for s, n in it.remasked],
            split=[(s - prompt_len, n) for s, n in it.split],
        ))
    ends = [len(result.token_ids)]
    for st in steps:
        ends += [o + n for o, n, _ in st.slots] + [o + n for o, n in st.chosen + st.accepted + st.remasked + st.split]
    at = [0] * max(ends)
    for i, st in enumerate(steps, 1):
        for o, n in st.accepted:
            for p in range(o, o + n):
                at[p] = at[p] or i
    token_at = {p - prompt_len: t for p, t in zip(result.buffer_pos, result.buffer_ids) if p >= prompt_len}
    cells = []
    for offset, when in enumerate(at):
        token = token_at.get(offset) if when else None
        eos = token is not None and token in eos_ids
        piece = "" if token is None else "<eos>" if eos else tokenizer.decode([token])
        cells.append(Cell(piece=piece, at=when, kept=offset < len(result.token_ids), eos=eos))
    return Lane(label=label, model=model, config=config, prompt_len=prompt_len, cells=cells, steps=steps,
                text=result.text, stats=result.stats.as_dict())


def lane_data(lane: Lane) -> dict[str, Any]:
    """The plain-JSON form of a lane the page reads (each step with its ``tokens``)."""
    data = asdict(lane)
    for d, st in zip(data["steps"], lane.steps):
        d["tokens"] = st.tokens
    return data


def _script_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element: every ``<``, ``>`` and ``&`` escaped as ``\\uXXXX``."""
    return json.dumps(value, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def build_html(lanes: Sequence[Lane], prompt: str, title: str) -> str:
    """One self-contained HTML page (no network): the prompt, a shared iteration slider with step / play
    buttons, the lanes side by side (cells, this iteration's details, the final text and stats)."""
    data = {"title": title, "prompt": prompt, "lanes": [lane_data(lane) for lane in lanes]}
    return (_PAGE.replace("__TITLE__", html.escape(title)).replace("__STYLE__", _STYLE)
            .replace("__SCRIPT__", _SCRIPT).replace("__DATA__", _script_json(data)))


# ------------------------------------------------------------------------------------ the animated SVG
CHAR_W, LINE_H, FONT = 7.2, 20, 12  # monospace advance (0.6 em) and line height, in px, at FONT px


def _wrap(pieces: Sequence[str], width: int) -> list[list[tuple[int, int, str]]]:
    """Lay ``pieces`` out as monospace text in lines of at most ``width`` characters: per line, per
    piece, (its index, its column, its shown text). A newline ends its line (shown as ``⏎``); a piece
    longer than a line gets a line of its own."""
    lines: list[list[tuple[int, int, str]]] = [[]]
    col = 0
    for i, piece in enumerate(pieces):
        newline = piece.endswith("\n")
        shown = piece.replace("\n", "⏎") or " "
        if col and col + len(shown) > width:
            lines.append([])
            col = 0
        lines[-1].append((i, col, shown))
        col += len(shown)
        if newline:
            lines.append([])
            col = 0
    return [line for line in lines if line] or [[]]


def build_svg(lanes: Sequence[Lane], title: str, width: int = 56, beat_s: float = 0.6, hold_s: float = 3.0) -> str:
    """An animated SVG of each lane's output cells filling in: lanes side by side, ``width`` characters per
    line, iteration i committing its cells at ``i * beat_s`` seconds, the final frame held ``hold_s``
    seconds, then again. Pure CSS keyframes; without animation (or with reduced motion) the final frame
    shows."""
    iterations = max((len(lane.steps) for lane in lanes), default=0)
    total = (iterations + 1) * beat_s + hold_s

    def pct(t: float) -> str:
        return f"{100 * t / total:.3f}%"

    css = [
        "text{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:%dpx;fill:#1f2328}" % FONT,
        ".h{font-family:system-ui,sans-serif;font-weight:600;font-size:14px}",
        ".n{font-family:system-ui,sans-serif;font-size:12px;fill:#57606a}",
        ".m{fill:#d8dee4}", ".c rect{fill:#dafbe1}",
        "@media (prefers-reduced-motion:reduce){*{animation:none!important}}",
    ]
    for i in range(iterations + 1):  # from{i}: hidden before beat i; only{i}: shown during beat i only
        t0, t1 = i * beat_s, (i + 1) * beat_s
        css.append(f"@keyframes from{i}{{0%,{pct(t0)}{{opacity:0}}{pct(t0 + 0.001)},100%{{opacity:1}}}}")
        css.append(f"@keyframes only{i}{{0%,{pct(t0)}{{opacity:0}}{pct(t0 + 0.001)},{pct(t1)}{{opacity:1}}"
                   f"{pct(t1 + 0.001)},100%{{opacity:0}}}}")
        css.append(f"@keyframes glow{i}{{0%,{pct(t0)}{{fill:#2da44e}}{pct(t1)},100%{{fill:#dafbe1}}}}")
        css.append(f".f{i}{{animation:from{i} {total:.2f}s linear infinite}}"
                   f".o{i}{{opacity:0;animation:only{i} {total:.2f}s linear infinite}}"
                   f".f{i} rect{{animation:glow{i} {total:.2f}s linear infinite}}")
    pad, lane_w = 12, width * CHAR_W
    layouts = [_wrap([c.piece for c in lane.cells if c.kept and not c.eos], width) for lane in lanes]
    top = 74
    height = top + max((len(lines) for lines in layouts), default=1) * LINE_H + 40
    total_w = pad + len(lanes) * (lane_w + 2 * pad)
    body = [f'<text class="h" x="{pad}" y="20">{html.escape(title)}</text>']
    for k, (lane, lines) in enumerate(zip(lanes, layouts)):
        x0 = pad + k * (lane_w + 2 * pad)
        body.append(f'<g class="lane"><text class="h" x="{x0}" y="42">{html.escape(lane.label)} '
                    f'<tspan class="n">on {html.escape(lane.model)}</tspan></text>')
        n = len(lane.steps)
        forwards = tokens = 0
        for i in range(n + 1):  # the counter: one text per iteration, the last one stays
            if i:
                forwards += lane.steps[i - 1].forwards
                tokens += lane.steps[i - 1].tokens
            cls = f"f{i}" if i == n else f"o{i}"
            body.append(f'<text class="n {cls}" x="{x0}" y="62">'
                        f"iteration {i}/{n} · {forwards} forwards · {tokens} tokens committed</text>")
        kept = [c for c in lane.cells if c.kept and not c.eos]
        for row, line in enumerate(lines):
            y = top + row * LINE_H
            for index, col, shown in line:
                cell = kept[index]
                x, w = x0 + col * CHAR_W, len(shown) * CHAR_W
                word = shown.lstrip(" ")  # leading spaces become an offset: renderers collapse them
                tx = x + (len(shown) - len(word)) * CHAR_W
                body.append(f'<rect class="m" x="{x:.1f}" y="{y}" width="{w - 1:.1f}" height="{LINE_H - 4}" rx="2"/>'
                            f'<g class="c f{cell.at}"><rect x="{x:.1f}" y="{y}" width="{w - 1:.1f}" '
                            f'height="{LINE_H - 4}" rx="2"/><text x="{tx:.1f}" y="{y + LINE_H - 8}">'
                            f"{html.escape(word, quote=False)}</text></g>")
        body.append("</g>")
    legend_y = height - 14
    body.append(f'<rect class="m" x="{pad}" y="{legend_y - 11}" width="14" height="14" rx="2"/>'
                f'<text class="n" x="{pad + 20}" y="{legend_y}">[MASK]</text>'
                f'<rect x="{pad + 80}" y="{legend_y - 11}" width="14" height="14" rx="2" fill="#2da44e"/>'
                f'<text class="n" x="{pad + 100}" y="{legend_y}">committed this iteration</text>'
                f'<rect x="{pad + 260}" y="{legend_y - 11}" width="14" height="14" rx="2" fill="#dafbe1"/>'
                f'<text class="n" x="{pad + 280}" y="{legend_y}">committed earlier (one beat = one iteration)</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" xml:space="preserve" width="{total_w:.0f}" '
            f'height="{height}" viewBox="0 0 {total_w:.0f} {height}">'
            f'<rect width="100%" height="100%" fill="#ffffff"/><style>{"".join(css)}</style>'
            + "".join(body) + "</svg>\n")


# ------------------------------------------------------------------------------------ decoding
def trace_lanes(prompt: str, task: str, decoders: Sequence[str], config: str | None = None,
                overrides: Sequence[str] = (), models: Sequence[str] = (),
                runtime: RuntimeOptions | None = None) -> list[Lane]:
    """Decode ``prompt`` (chat template on, as the bench does) with each decoder in ``decoders`` on its
    bench model and ``task``'s bench settings (then ``overrides``, ``key=value``); one lane each, in order.
    Every config is checked before any model loads; a model shared by two decoders loads once."""
    from refusion.core.config import build_decoder, validate_config
    from refusion.experiments.bench import bench_runs, load_bench_config, with_models
    from refusion.models.backend import Backbone
    from refusion.models.tokenizer import encode_prompt

    if not decoders:
        raise ConfigError("--decoders: give at least one decoder")
    if not prompt:
        raise ConfigError("--prompt: empty prompt; give some text")
    cfg = with_models(load_bench_config(config), list(models))
    runs = bench_runs(cfg, list(decoders), [task], list(overrides))
    for run in runs:
        validate_config(run.configs[task])
    runtime = cfg.runtime.override(runtime)
    backbones: dict[str, Backbone] = {}
    lanes = []
    for run in runs:
        if run.model not in backbones:
            backbones[run.model] = Backbone.from_pretrained(run.model, **runtime.model_dump())
        bb = backbones[run.model]
        decoder = build_decoder(bb, run.configs[task])
        ids = encode_prompt(bb.tokenizer, prompt)
        result = decoder.generate(ids)
        lanes.append(build_lane(run.label, run.model, run.configs[task], result, bb.tokenizer, len(ids), bb.eos_ids,
                                getattr(decoder.options, "slot_size", None)))
    return lanes


def add_trace_command(sub: Any) -> None:
    """Register ``refusion trace`` on an argparse subparsers object."""
    p = sub.add_parser("trace", help="decode one prompt with several decoders; an HTML page (and an animated SVG) "
                                     "of every iteration")
    p.add_argument("--decoders", default="refusion,llada",
                   help="comma-separated decoders, drawn side by side (models: the bench config's)")
    p.add_argument("--task", default="arith", help="tinybench task: the decoders' settings and gen_length, and "
                                                   "the prompt unless --prompt (default arith)")
    p.add_argument("--idx", type=int, default=0, help="the task sample whose query is the prompt (default 0)")
    add_split_arg(p)
    p.add_argument("--prompt", help="decode this text instead of the task sample (the task still gives the settings)")
    p.add_argument("--out", default="trace.html", help="the HTML page to write (default trace.html)")
    p.add_argument("--svg", help="the animated SVG to write (default: --out with the suffix .svg)")
    p.add_argument("--svg-width", type=int, default=56, metavar="CHARS", help="characters per SVG line (default 56)")
    add_bench_config_args(p, row_sets=True, rows="lane")
    add_machine_args(p)
    p.set_defaults(func=cmd_trace)


def cmd_trace(a: argparse.Namespace) -> int:
    """Run ``refusion trace``: write the page and the SVG, print one line per lane."""
    from refusion.core.threads import set_threads
    from refusion.tasks import get_task

    set_threads(a.threads)
    if a.svg_width < 8:
        raise ConfigError(f"--svg-width: must be at least 8, got {a.svg_width}")
    try:
        task = get_task(a.task)
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None
    if a.prompt is not None:
        prompt, title = a.prompt, f"refusion trace: a prompt, {a.task} settings"
    else:
        if a.idx < 0:
            raise ConfigError(f"--idx: must be at least 0, got {a.idx}")
        examples = task.examples(a.split, a.idx + 1)
        prompt, title = examples[a.idx].query, f"refusion trace: {a.task} {a.split} sample {a.idx}"
    lanes = trace_lanes(prompt, a.task, [d for d in a.decoders.split(",") if d], a.config, a.set, a.model,
                        runtime_from_args(a))
    out = Path(a.out)
    svg = Path(a.svg) if a.svg else out.with_suffix(".svg")
    for path in (out, svg):
        path.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(lanes, prompt, title), encoding="utf-8")
    svg.write_text(build_svg(lanes, title, width=a.svg_width), encoding="utf-8")
    for lane in lanes:
        s = lane.stats
        counts = [(s["iterations"], "iteration"), (s["nfe"], "forward"), (s["generated_tokens"], "token")]
        print(f"{lane.label} on {lane.model}: " + ", ".join(f"{n} {w}{'' if n == 1 else 's'}" for n, w in counts))
    print(f"wrote {out}, {svg}")
    return 0


# ------------------------------------------------------------------------------------ the page
_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title><style>__STYLE__</style></head>
<body>
<h1>__TITLE__</h1>
<details open><summary>prompt</summary><pre id="prompt" class="prompt"></pre></details>
<div class="controls">
<button id="first" title="before the first iteration (Home)">|&#9664;</button>
<button id="prev" title="previous iteration (&#8592;)">&#9664;</button>
<button id="play" title="play / pause (space)">play</button>
<button id="next" title="next iteration (&#8594;)">&#9654;</button>
<button id="last" title="after the last iteration (End)">&#9654;|</button>
<input id="slider" type="range" min="0" max="0" value="0" aria-label="iteration">
<span id="label"></span>
</div>
<div class="legend"><span class="cell mask">mask</span> still [MASK]
<span class="cell new">tok</span> committed this iteration <span class="cell done">tok</span> committed earlier
<span class="cell mask pool" style="--s:1">mask</span> in this iteration's scored pool (underline: score)
<span class="cell mask chosen">mask</span> chosen <span class="cell mask remask">mask</span> remasked
<span class="cell done dropped">tok</span> cut after the EOS</div>
<div id="lanes" class="lanes"></div>
<script type="application/json" id="trace-data">__DATA__</script>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:16px;color:#1f2328;background:#fff}
h1{font-size:18px;margin:0 0 8px}
pre.prompt,pre.final{background:#f6f8fa;border-radius:6px;padding:8px;white-space:pre-wrap;margin:4px 0;
 font:13px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.controls{position:sticky;top:0;z-index:2;background:#fff;display:flex;gap:6px;align-items:center;
 padding:8px 0;border-bottom:1px solid #d0d7de}
.controls input{flex:1}
.controls button{min-width:36px}
#label{min-width:140px;font-variant-numeric:tabular-nums}
.legend{font-size:12px;color:#57606a;margin:8px 0;line-height:2}
.lanes{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:16px}
.lane{border:1px solid #d0d7de;border-radius:6px;padding:10px;min-width:0}
.lane h2{font-size:15px;margin:0 0 6px}
.lane h2 small{font-weight:normal;color:#57606a}
.cells{font:13px/2 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;margin:6px 0}
.cell{white-space:pre;display:inline-block;border-radius:3px;padding:0 1px;margin:0 1px 2px 0;line-height:1.5;
 min-width:.6em;vertical-align:top}
.cell.mask{background:#d8dee4;color:transparent}
.cell.done{background:#dafbe1}
.cell.new{background:#2da44e;color:#fff}
.cell.dropped{text-decoration:line-through;opacity:.45}
.cell.eos{font-style:italic;color:#8250df}
.cell.new.eos{color:#fff}
.cell.pool{box-shadow:inset 0 -4px 0 rgba(9,105,218,var(--s))}
.cell.chosen{outline:2px solid #bf8700;outline-offset:-1px}
.cell.remask{outline:2px dashed #cf222e;outline-offset:-1px}
.cell.slot-start{border-left:3px solid #57606a}
.details{font-size:13px;border-top:1px solid #d0d7de;padding-top:6px}
.details .head{font-weight:600}
.details table{border-collapse:collapse;font-variant-numeric:tabular-nums;margin:4px 0}
.details td,.details th{padding:1px 8px;border-bottom:1px solid #eaeef2;text-align:right}
.details tr.chosen td{background:#fff8c5}
.details tr.acc td{background:#dafbe1}
.chart{width:100%;height:44px;background:#f6f8fa;border-radius:4px;display:block;margin:4px 0}
.stats{font-size:12px;color:#57606a}
"""

_SCRIPT = r"""
(function () {
  const D = JSON.parse(document.getElementById('trace-data').textContent);
  const T = Math.max(0, ...D.lanes.map(l => l.steps.length));
  const slider = document.getElementById('slider'), label = document.getElementById('label');
  const esc = s => String(s).replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
  const span = (o, n) => n > 1 ? o + '\u2013' + (o + n - 1) : String(o);
  document.getElementById('prompt').textContent = D.prompt;
  slider.max = T;
  const views = D.lanes.map(L => {
    const el = document.createElement('section');
    el.className = 'lane';
    el.innerHTML = '<h2>' + esc(L.label) + ' <small>on ' + esc(L.model) + '</small></h2>' +
      '<div class="cells"></div><div class="details"></div>' +
      '<div><b>final text</b></div><pre class="final"></pre><div class="stats"></div>';
    const box = el.querySelector('.cells'), cells = [];
    L.cells.forEach((c, i) => {
      const s = document.createElement('span');
      s.textContent = c.at ? (c.piece.replace(/\n/g, '\u23ce') || '\u00b7') : '\u2007\u2007';
      box.appendChild(s);
      if (c.piece.endsWith('\n')) box.appendChild(document.createElement('br'));
      cells.push(s);
    });
    el.querySelector('.final').textContent = L.text;
    const st = L.stats;
    el.querySelector('.stats').textContent = st.generated_tokens + ' tokens, ' + st.nfe + ' forwards (TPF ' +
      st.tpf.toFixed(2) + '), ' + st.iterations + ' iterations, ' + (1000 * st.wall_s).toFixed(0) + ' ms';
    document.getElementById('lanes').appendChild(el);
    return {L, el, cells, details: el.querySelector('.details')};
  });

  function chart(slots, chosen, accepted) {
    if (!slots.length) return '';
    const n = slots.length, w = 100 / n;
    const bars = slots.map(([o, size, score], i) => {
      const fill = accepted.has(o) ? '#2da44e' : chosen.has(o) ? '#bf8700' : '#0969da';
      return '<rect x="' + (i * w + w * 0.1) + '" y="' + (1 - score) + '" width="' + (w * 0.8) + '" height="' +
        score + '" fill="' + fill + '"><title>' + span(o, size) + ': ' + score.toFixed(4) + '</title></rect>';
    }).join('');
    return '<svg class="chart" viewBox="0 0 100 1" preserveAspectRatio="none">' + bars + '</svg>';
  }

  function describe(L, t) {
    const n = L.steps.length;
    if (t === 0) return '<div class="head">before iteration 1 of ' + n + '</div>' + L.cells.length +
      ' positions, all [MASK]';
    if (t > n) return '<div class="head">finished after ' + n + ' iterations</div>';
    const s = L.steps[t - 1];
    let fwd = 0, tok = 0;
    for (let i = 0; i < t; i++) { fwd += L.steps[i].forwards; tok += L.steps[i].tokens; }
    const chosen = new Set(s.chosen.map(c => c[0])), accepted = new Set(s.accepted.map(a => a[0]));
    let h = '<div class="head">iteration ' + t + '/' + n + ' \u00b7 block ' + s.block + ' \u00b7 stage ' + esc(s.stage) +
      ' \u00b7 ' + s.forwards + ' forward' + (s.forwards === 1 ? '' : 's') + ' \u00b7 ' + s.tokens + ' token' +
      (s.tokens === 1 ? '' : 's') + ' committed</div>';
    h += '<div>so far: ' + fwd + ' forwards, ' + tok + ' tokens' + (s.rounds ? ' \u00b7 Stage II-b rounds: ' + s.rounds : '') +
      (s.fused ? ' \u00b7 Stage I logits reused from the previous verification forward' : '') + '</div>';
    h += chart(s.slots, chosen, accepted);
    const wide = s.slots.some(x => x[1] > 1) || s.chosen.some(x => x[1] > 1);
    if (wide) {
      const acc = new Map(s.accepted);
      h += '<table><tr><th>slot</th><th>size</th><th>score</th><th>chosen</th><th>accepted</th></tr>' +
        s.slots.map(([o, size, score]) => '<tr class="' + (acc.has(o) ? 'acc' : chosen.has(o) ? 'chosen' : '') +
          '"><td>' + span(o, size) + '</td><td>' + size + '</td><td>' + score.toFixed(4) + '</td><td>' +
          (chosen.has(o) ? 'yes' : '') + '</td><td>' + (acc.has(o) ? acc.get(o) : '') + '</td></tr>').join('') +
        '</table>';
      const extra = s.accepted.filter(([o]) => !s.slots.some(x => x[0] === o));
      if (extra.length) h += '<div>accepted: ' + extra.map(([o, m]) => span(o, m)).join(', ') + '</div>';
    } else if (s.slots.length) {
      const sc = s.slots.map(x => x[2]);
      const inC = s.slots.filter(x => chosen.has(x[0])).map(x => x[2]);
      const outC = s.slots.filter(x => !chosen.has(x[0])).map(x => x[2]);
      h += '<div>scored ' + s.slots.length + ' masked positions (scores ' + Math.min(...sc).toFixed(3) + '\u2013' +
        Math.max(...sc).toFixed(3) + '); committed ' + s.tokens + (inC.length ? ', lowest committed score ' +
        Math.min(...inC).toFixed(3) : '') + (outC.length ? ', highest left masked ' + Math.max(...outC).toFixed(3) : '') +
        '</div>';
    } else {
      h += '<div>committed at position ' + s.accepted.map(([o, m]) => span(o, m)).join(', ') + '</div>';
    }
    if (s.split.length) h += '<div>split off (back to the pool): ' + s.split.map(([o, m]) => span(o, m)).join(', ') + '</div>';
    if (s.remasked.length) h += '<div>remasked (back to the pool): ' + s.remasked.map(([o, m]) => span(o, m)).join(', ') + '</div>';
    return h;
  }

  function renderLane(v, t) {
    const L = v.L, n = L.steps.length, k = Math.min(t, n), s = t >= 1 && t <= n ? L.steps[t - 1] : null;
    const pool = new Map(), chosen = new Set(), remask = new Set(), starts = new Set();
    if (s) {
      s.slots.forEach(([o, size, score]) => { for (let p = o; p < o + size; p++) pool.set(p, score); if (size > 1) starts.add(o); });
      s.chosen.forEach(([o, size]) => { for (let p = o; p < o + size; p++) chosen.add(p); });
      s.remasked.forEach(([o, size]) => { for (let p = o; p < o + size; p++) remask.add(p); });
    }
    v.cells.forEach((el, i) => {
      const c = L.cells[i], shown = c.at > 0 && c.at <= k;
      let cls = 'cell ' + (!shown ? 'mask' : c.at === t ? 'new' : 'done');
      if (shown && !c.kept) cls += ' dropped';
      if (shown && c.eos) cls += ' eos';
      if (pool.has(i)) { cls += ' pool'; el.style.setProperty('--s', pool.get(i).toFixed(3)); }
      if (chosen.has(i)) cls += ' chosen';
      if (remask.has(i)) cls += ' remask';
      if (starts.has(i)) cls += ' slot-start';
      el.className = cls;
      el.title = 'position ' + i + (c.at ? ': ' + JSON.stringify(c.piece) + ', committed at iteration ' + c.at +
        (c.kept ? '' : ' (cut: after the EOS)') : ': never committed') + (pool.has(i) ? '; score ' + pool.get(i).toFixed(4) : '');
    });
    v.details.innerHTML = describe(L, t);
  }

  let cur = 0, timer = null;
  function render(t) {
    cur = Math.max(0, Math.min(T, t));
    slider.value = cur;
    label.textContent = 'iteration ' + cur + ' / ' + T;
    views.forEach(v => renderLane(v, cur));
  }
  function stop() { if (timer) { clearInterval(timer); timer = null; } document.getElementById('play').textContent = 'play'; }
  function play() {
    if (timer) return stop();
    if (cur >= T) render(0);
    document.getElementById('play').textContent = 'pause';
    timer = setInterval(() => { if (cur >= T) stop(); else render(cur + 1); }, 700);
  }
  document.getElementById('first').onclick = () => { stop(); render(0); };
  document.getElementById('prev').onclick = () => { stop(); render(cur - 1); };
  document.getElementById('next').onclick = () => { stop(); render(cur + 1); };
  document.getElementById('last').onclick = () => { stop(); render(T); };
  document.getElementById('play').onclick = play;
  slider.oninput = () => { stop(); render(+slider.value); };
  document.addEventListener('keydown', e => {
    if (e.target === slider) return;
    if (e.key === 'ArrowLeft') { stop(); render(cur - 1); }
    else if (e.key === 'ArrowRight') { stop(); render(cur + 1); }
    else if (e.key === 'Home') { stop(); render(0); }
    else if (e.key === 'End') { stop(); render(T); }
    else if (e.key === ' ') { e.preventDefault(); play(); }
  });
  render(T);
})();
"""
