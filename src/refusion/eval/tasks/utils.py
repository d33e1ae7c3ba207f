"""Metric of the tinybench lm-eval tasks: ``process_results`` scores a completion with the task's own
:meth:`~refusion.tasks.base.Task.score` (exact answer match; code: the unit tests in the sandbox)."""

from __future__ import annotations

import json
from typing import Any

from refusion.tasks import Example, get_task


def doc_to_example(doc: dict[str, Any]) -> Example:
    return Example(doc["task"], doc["query"], doc["response"], doc["answer"], json.loads(doc.get("meta_json") or "{}"))


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``{"acc": 1.0 | 0.0}`` for the (first) completion of one document."""
    example = doc_to_example(doc)
    return {"acc": float(get_task(example.task).score(example, results[0]))}
