"""tinybench as local lm-evaluation-harness tasks: ``tinybench_arith``, ``tinybench_code``, ``tinybench_facts``
and the group tag ``tinybench``.

:func:`write_lm_eval_tasks` exports each task's test split to ``<dir>/tinybench_<task>.jsonl`` and writes a
YAML next to it whose ``data_files`` path is ABSOLUTE (how the harness resolves relative paths is not
specified), then ``--include_path <dir>`` (``refusion eval --include-path``) makes them available::

    task: tinybench_arith
    dataset_path: json
    dataset_kwargs: {data_files: {test: /abs/dir/tinybench_arith.jsonl}}
    test_split: test
    output_type: generate_until
    doc_to_text: "{{prompt}}"            # query + "\\n": the project's prompt format
    generation_kwargs: {until: [...], max_gen_toks: <task.max_new_tokens>, do_sample: false}
    process_results: !function refusion.eval.tasks.utils.process_results   # the task's own score()
    metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]

Prompts are plain (``query + "\\n"``, as the tiny models were trained); run these tasks without
``--apply_chat_template``. ``refusion eval --tasks tinybench_arith`` writes them on its own.

The ReFusion paper's evaluation tasks (``refusion_gsm8k_cot``, ...) are YAML files shipped in
:mod:`refusion.eval.tasks.paper` (docs/paper_tasks.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from refusion.tasks import TASKS, get_task

PREFIX = "tinybench_"
TAG = "tinybench"


def task_names() -> list[str]:
    return [PREFIX + name for name in TASKS]


def write_lm_eval_tasks(directory: str | os.PathLike, n: int | None = None, tasks: list[str] | None = None) -> Path:
    """Write ``tinybench_<task>.jsonl`` (first ``n`` test examples; default: the whole split) and
    ``tinybench_<task>.yaml`` for each task into ``directory``; returns the absolute directory."""
    out = Path(directory).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in tasks or list(TASKS):
        task = get_task(name.removeprefix(PREFIX))
        data = out / f"{PREFIX}{task.name}.jsonl"
        with open(data, "w", encoding="utf-8") as fh:
            for e in task.examples("test", n):
                fh.write(json.dumps({
                    "task": e.task, "query": e.query, "prompt": e.query + "\n", "response": e.response,
                    "answer": e.answer, "meta_json": json.dumps(e.meta),
                }, ensure_ascii=False) + "\n")
        spec = {
            "task": f"{PREFIX}{task.name}",
            "tag": [TAG],
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["<|endoftext|>"], "max_gen_toks": int(task.max_new_tokens), "do_sample": False},
            "num_fewshot": 0,
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        }
        text = yaml.safe_dump(spec, sort_keys=False)
        # the harness resolves `!function` tags itself; yaml.safe_dump cannot write them
        text += "process_results: !function refusion.eval.tasks.utils.process_results\n"
        (out / f"{PREFIX}{task.name}.yaml").write_text(text, encoding="utf-8")
    return out
