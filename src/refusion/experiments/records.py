"""Append-only JSONL records for long runs: each finished result is written and flushed as it completes.

A killed run leaves at most one torn last line; :func:`load_records` drops it with a warning, and a
resumed run skips every key already recorded.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (missing file -> []); a torn last line is dropped."""
    p = Path(path)
    if not p.is_file():
        return []
    lines = p.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                warnings.warn(f"{p}: dropped a torn last line (an interrupted write); it will be redone", stacklevel=2)
                _truncate_last_line(p)
            else:
                raise ValueError(f"{p}: line {i + 1} is not valid JSON; the file is corrupt") from None
    return out


def _truncate_last_line(p: Path) -> None:
    data = p.read_bytes().rstrip(b"\n")
    cut = data.rfind(b"\n")
    p.write_bytes(data[: cut + 1] if cut >= 0 else b"")


class RecordWriter:
    """Appends one JSON object per line, flushed and fsynced, so a crash loses at most the current one."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Replace the JSONL file at ``path`` with ``records`` (written to a temporary file, then renamed over it)."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(p)


def done_keys(records: Iterable[dict[str, Any]], fields: tuple[str, ...]) -> set[tuple]:
    return {tuple(r[f] for f in fields) for r in records}
