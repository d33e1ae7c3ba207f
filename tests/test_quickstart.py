"""The quickstart in refusion/__init__.py and docs/quickstart.md runs as written."""

import re
from pathlib import Path

import refusion


def test_the_quickstart_runs_and_every_export_resolves(capsys):
    code = re.search(r"```python\n(.*?)```", (Path(__file__).parents[1] / "docs" / "quickstart.md").read_text(), re.S)
    exec(compile(code.group(1), "quickstart", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert printed[-1] == "True" and float(printed[-2]) > 1.0  # the tiny model answers this prompt; TPF > 1
    for name in refusion.__all__:
        assert getattr(refusion, name) is not None
