"""tinybench: the generated tasks tiny models are trained and evaluated on (arith, code, facts).

``TASKS`` maps names to task instances (the level the models are trained on); ``HARD_TASKS`` the
harder level of each (``arith_hard``, ``code_hard``, ``facts_hard``: evaluation only, never in the
training mixture); :func:`get_task` finds both. ``export_json`` writes a split in the reference training
format (a JSON list of ``{"query", "response"}`` records, responses without eos).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from refusion.tasks.arith import ArithHardTask, ArithTask
from refusion.tasks.base import SPLITS, Example, Task, split_of
from refusion.tasks.code import CodeHardTask, CodeTask
from refusion.tasks.facts import FactsHardTask, FactsTask

TASKS: dict[str, Task] = {task.name: task for task in (ArithTask(), CodeTask(), FactsTask())}
HARD_TASKS: dict[str, Task] = {task.name: task for task in (ArithHardTask(), CodeHardTask(), FactsHardTask())}

__all__ = ["HARD_TASKS", "SPLITS", "TASKS", "Example", "Task", "chance_accuracy", "corpus", "export_json", "get_task", "split_of"]


def get_task(name: str) -> Task:
    task = TASKS.get(name) or HARD_TASKS.get(name)
    if task is None:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join([*TASKS, *HARD_TASKS])}")
    return task


def chance_accuracy(name: str) -> float:
    """The accuracy of guessing on a task (0 for a name that is not a tinybench task)."""
    task = TASKS.get(name) or HARD_TASKS.get(name)
    return task.chance_accuracy if task else 0.0


def export_json(path: str | os.PathLike, tasks: list[str], split: str, n: int | None = None) -> int:
    """Write the first ``n`` examples of ``split`` of each task as ``[{"query", "response"}, ...]``."""
    records = [{"query": e.query, "response": e.response} for name in tasks for e in get_task(name).examples(split, n)]
    Path(path).write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
    return len(records)


def corpus(split: str = "train") -> list[Example]:
    """Every task's examples of a split (default sizes), task by task."""
    return [e for task in TASKS.values() for e in task.examples(split)]
