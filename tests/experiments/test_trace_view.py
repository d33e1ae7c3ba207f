"""`refusion trace`: lanes from real decodes on the shipped tiny models, the slot sizes rebuilt from the
trace against the decoder's own, the HTML page and the animated SVG; slow: the page in headless Chromium."""

from __future__ import annotations

import html
import json
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from refusion.cli import main
from refusion.core.config import build_decoder
from refusion.core.types import IterationTrace
from refusion.decoders.refusion import RefusionDecoder
from refusion.experiments.bench import load_bench_config
from refusion.experiments.trace_view import (
    Cell, Lane, Step, build_html, build_svg, lane_data, slot_sizes, trace_lanes,
)
from refusion.models.backend import Backbone
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task

CHROMIUM = Path("/usr/bin/chromium")
DECODERS = ("refusion", "llada", "block")


@pytest.fixture(scope="module")
def prompt() -> str:
    return get_task("arith").examples("test", 1)[0].query


@pytest.fixture(scope="module")
def lanes(prompt) -> list[Lane]:
    return trace_lanes(prompt, "arith", DECODERS)


def test_lanes_follow_each_decode(lanes):
    assert [lane.label for lane in lanes] == list(DECODERS)
    for lane in lanes:
        n = len(lane.steps)
        assert n == lane.stats["iterations"] > 0
        assert sum(st.forwards for st in lane.steps) == lane.stats["nfe"]
        kept = [c for c in lane.cells if c.kept]
        assert len(kept) == lane.stats["generated_tokens"] and all(0 < c.at <= n for c in kept)
        assert "".join(c.piece for c in kept if not c.eos) == lane.text
        for i, st in enumerate(lane.steps, 1):
            assert sum(c.at == i for c in lane.cells) == st.tokens > 0  # every accepted position, once
            for o, size, _ in st.slots:  # a scored slot is still masked when scored
                assert all(c.at == 0 or c.at >= i for c in lane.cells[o : o + size])
            assert {o for o, _ in st.chosen} <= {o for o, _, _ in st.slots} or lane.label == "ar"
    refusion, llada, block = lanes
    assert {st.stage for st in refusion.steps} <= {"II-a", "II-b"} and any(st.stage == "II-b" for st in refusion.steps)
    assert all(size == 16 for _, size, _ in refusion.steps[0].slots)  # arith's bench slot size
    assert any(st.rounds for st in refusion.steps)
    for lane in (llada, block):
        assert all(size == 1 for st in lane.steps for _, size, _ in st.slots)


def test_slot_sizes_on_a_made_up_trace():
    # prompt of 10, slots of 4: 10-13, 14-17, 18-21
    trace = [
        IterationTrace(block=0, stage="II-b", scored=[(10, 0.9), (14, 0.8), (18, 0.1)], chosen=[10], accepted=[(10, 1)],
                       forwards=3, remasked=[(11, 3)]),
        IterationTrace(block=0, stage="II-a", scored=[(11, 0.7), (14, 0.6), (18, 0.2)], chosen=[14], accepted=[(14, 2)],
                       forwards=2, split=[(16, 2)]),
        IterationTrace(block=0, stage="II-a", scored=[(11, 0.5), (16, 0.5), (18, 0.3)], chosen=[16, 18],
                       accepted=[(16, 2)], forwards=2),
    ]
    assert slot_sizes(trace, 10, 4) == [{10: 4, 14: 4, 18: 4}, {11: 3, 14: 4, 18: 4}, {11: 3, 16: 2, 18: 4}]
    assert slot_sizes(trace, 10, None)[2] == {11: 1, 16: 1, 18: 1}


@pytest.mark.parametrize("settings, event", [
    ({"split_threshold": 0.9}, "split"),  # adaptive slots: tails split off
    ({"remasker": {"name": "sub_slot", "threshold": 0.999}, "correct": False, "join_adjacent": False}, "remasked"),
    ({"remasker": {"name": "sub_slot", "threshold": 0.99}}, "remasked"),  # joined rows, suffixes cut on the grid
])
def test_slot_sizes_are_the_decoders_own(monkeypatch, prompt, settings, event):
    seen: list[dict[int, int]] = []  # per iteration: the drafted pool slots, from inside the decoder
    stage_one = RefusionDecoder._stage_one

    def spy(self, *args, **kwargs):
        out = yield from stage_one(self, *args, **kwargs)
        seen.append({s.start: s.size for s in out[1]})
        return out

    monkeypatch.setattr(RefusionDecoder, "_stage_one", spy)
    bb = Backbone.from_pretrained("tiny-refusion")
    config = {**load_bench_config().decoder_config("arith", "refusion", get_task("arith").max_new_tokens), **settings}
    decoder = build_decoder(bb, config)
    ids = encode_prompt(bb.tokenizer, prompt)
    result = decoder.generate(ids)
    assert any(getattr(it, event) for it in result.trace)  # the case under test happened
    assert slot_sizes(result.trace, len(ids), decoder.options.slot_size) == seen


def _script_data(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S).group(1))


def test_the_page_is_self_contained_and_carries_every_lane(lanes, prompt):
    page = build_html(lanes, prompt, "arith test sample 0")
    assert page.startswith("<!DOCTYPE html>") and page.count("<script") == 2 and page.count("</script>") == 2
    assert not re.search(r"\b(?:src|href)\s*=|https?:|<link|@import|url\(", page)  # nothing fetched
    assert _script_data(page) == json.loads(json.dumps(
        {"title": "arith test sample 0", "prompt": prompt, "lanes": [lane_data(lane) for lane in lanes]}))
    for i, d in enumerate(_script_data(page)["lanes"]):
        assert [s["tokens"] for s in d["steps"]] == [st.tokens for st in lanes[i].steps]
    for element in ('id="slider"', 'id="play"', 'id="next"', 'id="prev"', 'id="lanes"'):
        assert element in page


def test_markup_in_the_text_stays_data():
    hostile = "</script><script>alert(1)</script><!--"
    lane = Lane(label="x<b>", model="m", config={}, prompt_len=3, text=hostile, stats={},
                cells=[Cell(piece=hostile, at=1, kept=True)],
                steps=[Step(block=0, stage="ar", forwards=1, rounds=0, fused=False, slots=[], chosen=[(0, 1)],
                            accepted=[(0, 1)])])
    page = build_html([lane], hostile, "t</title>")
    assert page.count("</script>") == 2 and "<!--" not in page and "t</title>" not in page
    assert _script_data(page)["lanes"][0]["text"] == hostile
    root = ET.fromstring(build_svg([lane], hostile))  # well-formed: the text is escaped
    assert hostile in "".join(root.itertext())


def _svg_lanes(svg: str) -> list[list[tuple[int, str]]]:
    """Per lane, the (iteration, text) of each animated cell, in drawing order."""
    ns = {"s": "http://www.w3.org/2000/svg"}
    lanes = []
    for lane in ET.fromstring(svg).findall("s:g[@class='lane']", ns):
        cells = []
        for g in lane.findall("s:g", ns):
            (beat,) = [int(c[1:]) for c in g.get("class").split() if re.fullmatch(r"f\d+", c)]
            cells.append((beat, g.find("s:text", ns).text or ""))
        lanes.append(cells)
    return lanes


def test_the_svg_fills_each_lanes_output_by_iteration(lanes):
    svg = build_svg(lanes, "arith test sample 0", width=56)
    drawn = _svg_lanes(svg)
    assert len(drawn) == len(lanes)
    for lane, cells in zip(lanes, drawn):
        kept = [c for c in lane.cells if c.kept and not c.eos]
        assert [beat for beat, _ in cells] == [c.at for c in kept]  # each output cell appears at its iteration
        assert "".join(t for _, t in cells).replace("⏎", "") == re.sub(r"\s", "", lane.text)
        for i in range(len(lane.steps) + 1):  # the counter names each iteration
            assert f"iteration {i}/{len(lane.steps)} " in svg
    for beat in {c.at for lane in lanes for c in lane.cells if c.kept}:
        assert f"@keyframes from{beat}{{" in svg and f".f{beat}{{animation:from{beat} " in svg
    assert "<script" not in svg and "https:" not in svg


def test_the_command_writes_the_page_and_the_svg(tmp_path, capsys):
    out = tmp_path / "t" / "trace.html"
    assert main(["trace", "--decoders", "block,refusion", "--task", "facts", "--idx", "1", "--out", str(out),
                 "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "block on tiny-block:" in printed and "refusion on tiny-refusion:" in printed
    page, svg = out.read_text(), out.with_suffix(".svg").read_text()
    assert [d["label"] for d in _script_data(page)["lanes"]] == ["block", "refusion"]
    assert _script_data(page)["prompt"] == get_task("facts").examples("test", 2)[1].query
    ET.fromstring(svg)
    other = tmp_path / "x.svg"
    assert main(["trace", "--decoders", "refusion", "--prompt", "Ana has 3 apples and buys 4 more.\nHow many?",
                 "--out", str(tmp_path / "p.html"), "--svg", str(other), "--threads", "1"]) == 0
    assert _script_data((tmp_path / "p.html").read_text())["prompt"].startswith("Ana has 3 apples")
    assert other.exists()


def test_the_speculative_rows_are_traced_beside_ar(tmp_path, capsys):
    out = tmp_path / "spec.html"
    assert main(["trace", "--decoders", "ar,spec-ngram,spec-diffusion", "--task", "facts", "--out", str(out),
                 "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    lanes = _script_data(out.read_text())["lanes"]
    assert [d["label"] for d in lanes] == ["ar", "spec-ngram", "spec-diffusion"]
    assert "spec-diffusion on tiny-ar:" in printed
    ET.fromstring(out.with_suffix(".svg").read_text())


@pytest.mark.parametrize("argv, message", [
    (["--decoders", "nope"], "no model configured"),
    (["--idx", "-1"], "--idx"),
    (["--prompt", ""], "--prompt"),
    (["--task", "poetry"], "--task"),
    (["--decoders", ""], "--decoders"),
])
def test_the_command_refuses_bad_flags(tmp_path, capsys, argv, message):
    assert main(["trace", "--out", str(tmp_path / "t.html"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.html").exists()


PROBE = """<script>(function () {
  const $ = id => document.getElementById(id), log = [];
  const read = () => ({label: $('label').textContent, lanes: [...document.querySelectorAll('.lane')].map(el => ({
    head: el.querySelector('.details .head').textContent,
    fresh: el.querySelectorAll('.cells .cell.new').length,
    done: el.querySelectorAll('.cells .cell.done').length,
    text: [...el.querySelectorAll('.cells .cell.new, .cells .cell.done')]
      .filter(c => !c.classList.contains('dropped') && !c.classList.contains('eos')).map(c => c.textContent).join(''),
    final: el.querySelector('.final').textContent}))});
  $('first').click();
  log.push(read());
  for (let i = 0; i < 10000 && $('slider').value !== $('slider').max; i++) { $('next').click(); log.push(read()); }
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify(log);
  document.body.appendChild(pre);
})();</script>"""


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium to render the page "
                                                  "(apt-get install -y chromium chromium-driver)")
def test_the_page_in_headless_chromium_shows_every_iteration_and_the_final_text(lanes, prompt, tmp_path):
    """The page's own buttons step from before the first iteration to after the last; at every step each
    lane shows its iteration's header and exactly the cells committed so far, and at the end the text."""
    page = tmp_path / "trace.html"
    page.write_text(build_html(lanes, prompt, "arith test sample 0").replace("</body>", PROBE + "</body>"))
    dom = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, f"the page's script did not run: {dom[-500:]!r}"
    log = json.loads(html.unescape(found.group(1)))
    T = max(len(lane.steps) for lane in lanes)
    assert len(log) == T + 1
    for t, shot in enumerate(log):
        assert shot["label"] == f"iteration {t} / {T}"
        for lane, seen in zip(lanes, shot["lanes"], strict=True):
            n = len(lane.steps)
            head = (f"iteration {t}/{n} " if 1 <= t <= n else f"before iteration 1 of {n}" if t == 0
                    else f"finished after {n} iterations")
            assert seen["head"].startswith(head), (t, lane.label, seen["head"])
            assert seen["fresh"] == sum(0 < c.at == t for c in lane.cells)
            assert seen["done"] == sum(0 < c.at <= min(t, n) and c.at != t for c in lane.cells)
            assert seen["final"] == lane.text
    for lane, seen in zip(lanes, log[-1]["lanes"]):
        assert seen["text"] == lane.text.replace("\n", "⏎")
