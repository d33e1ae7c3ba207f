"""The user pages (README.md and docs/*.md) stand on their own in this repository.

A user page describes what the project does now and how to run it; the record of how it got there lives
in CHANGELOG.md and docs/history/, which these checks leave alone. On every user page:

- no link or mention leaves the repository (``../shared``, ``shared/reference``), and every relative link
  (and its ``#anchor``) resolves;
- every repository path it names (``docs/...``, ``src/...``, ``scripts/...``, ``tests/...``,
  ``examples/...``) exists;
- every ``runs/`` folder it names is one a command on the same page creates (``--out runs/x`` or another
  output option, ``mkdir runs/x``, ``> runs/x``, or the output folder of a ``scripts/*.sh``), or lies inside
  one: a reader has no other ``runs/`` folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/history/ is not a user page

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
OUTSIDE = re.compile(r"\.\./shared|shared/reference")
RUNS = re.compile(r"(?<![\w/.-])runs/[\w.-]+(?:/[\w.-]+)*")
REPO_PATH = re.compile(r"(?<![\w/.~-])(?:docs|src|scripts|tests|examples)/[\w.-]+(?:/[\w.-]+)*")
CREATES = [
    re.compile(r"--(?:out|output|out-dir|output-dir)(?:=|\s+)(runs/[\w.-]+(?:/[\w.-]+)*)"),
    re.compile(r"\bmkdir\s+(?:-\w+\s+)*((?:runs/[\w.{},/-]+\s*)+)"),
    re.compile(r">\s*(runs/[\w.-]+(?:/[\w.-]+)*)"),
    re.compile(r"\bscripts/[\w/.-]+\.sh\s+(runs/[\w.-]+(?:/[\w.-]+)*)"),
]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_blocks(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The page without its code blocks and inline code, where links live."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def created_runs(text: str) -> set[str]:
    made = set()
    for block in code_blocks(text):
        for pattern in CREATES:
            for m in pattern.finditer(block):
                for path in m.group(1).split():
                    made.add(path.rstrip("/"))
    return made


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_nothing_points_outside_the_repository(page):
    text = page.read_text()
    outside = [m.group(0) for m in OUTSIDE.finditer(text)]
    assert not outside, f"{page_id(page)} points outside the repository: {outside}"
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][\w+.-]*:|#", target):
            continue
        resolved = (page.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"{page_id(page)} links outside the repository: {target}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][\w+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page_id(page)}: links whose target or anchor does not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_repository_paths_named_exist(page):
    text = page.read_text()
    missing = []
    for m in REPO_PATH.finditer(text):
        if text[m.end():m.end() + 1] in ("*", "{", "<"):  # a pattern or placeholder, not a path
            continue
        path = m.group(0).rstrip(".")
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{page_id(page)} names repository paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_runs_folders_are_created_on_the_same_page(page):
    text = page.read_text()
    made = created_runs(text)
    named = {m.group(0).rstrip("./") for m in RUNS.finditer(text)}
    foreign = sorted(p for p in named if not any(p == c or p.startswith(c + "/") for c in made))
    assert not foreign, (f"{page_id(page)} names runs/ folders that no command on the page creates: {foreign} "
                         f"(created on the page: {sorted(made)})")


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The rules above on a page written to break each of them."""
    page = tmp_path / "page.md"
    page.write_text("See [x](../shared/reference/a.md) and [y](missing.md#z).\n\n"
                    "```bash\nrefusion bench --out runs/mine\nmkdir -p runs/a runs/b\n```\n\n"
                    "Then `runs/mine/results.json`, `runs/a` and `runs/elsewhere`.\n")
    text = page.read_text()
    assert OUTSIDE.search(text)
    assert created_runs(text) == {"runs/mine", "runs/a", "runs/b"}
    named = {m.group(0).rstrip("./") for m in RUNS.finditer(text)}
    assert named - {"runs/mine", "runs/a", "runs/b"} == {"runs/mine/results.json", "runs/elsewhere"}
    assert LINK.findall(prose(text)) == ["../shared/reference/a.md", "missing.md#z"]
    assert slug("`refusion bench`: the main job") == "refusion-bench-the-main-job"
    assert slug("What is checked on CPU, and what only GPUs show") == "what-is-checked-on-cpu-and-what-only-gpus-show"


def test_reliability_lists_every_contract_refusion_testing_checks():
    """docs/reliability.md's table of contracts per part kind is refusion.testing's CONTRACTS, row by row."""
    from refusion.testing.checks import CONTRACTS

    page = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `") and line.count("|") == 4]
    listed = [(r.split("|")[1].strip(" `"), r.split("|")[3].strip()) for r in rows]
    assert listed == [(kind, s) for kind, statements in CONTRACTS.items() for s in statements]


def test_the_ablation_schema_page_is_generated_from_its_model():
    """docs/ablations.md's schema section is refusion.experiments.ablate.schema_markdown(): regenerate it
    after changing AblationConfig or the models of its fields."""
    from refusion.experiments.ablate import schema_markdown

    page = (ROOT / "docs" / "ablations.md").read_text()
    section = page.split("<!-- schema: generated by refusion.experiments.ablate.schema_markdown() -->\n", 1)[1]
    assert section.split("<!-- end of schema -->", 1)[0] == schema_markdown()


def test_docs_hold_only_pages_and_figures():
    """docs/ (docs/history/ included) holds Markdown pages and their figures only: configs live in
    src/refusion/experiments/configs/, scripts and logs under scripts/."""
    others = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*")
                    if p.is_file() and p.suffix not in (".md", ".png", ".svg"))
    assert others == [], f"not a page or figure: {others}"
