"""The ReFusion paper's evaluation tasks as lm-evaluation-harness task configs (docs/paper_tasks.md).

The YAML files in this folder (:data:`TASKS_DIR`) define ``refusion_gsm8k_cot``, ``refusion_minerva_math``
(a group of 7), ``refusion_mbpp``, ``refusion_humaneval_instruct_noprefix``,
``refusion_gpqa_main_generative_n_shot``, ``refusion_arc_challenge_chat`` and ``refusion_mmlu_pro`` (a group
of 14): the prompts, stop strings, filters and metrics with which the reference implementation
(ML-GSAI/ReFusion) evaluated, zero-shot. ``refusion eval`` always includes this folder; with the harness
directly: ``lm_eval --include_path <TASKS_DIR> ...`` or ``TaskManager(include_path=TASKS_DIR)``.

The functions the YAMLs call are in :mod:`.hooks`; text post-processing (special tokens, ```python
blocks, HumanEval's sanitizer) in :mod:`.postprocess`; MATH answer normalisation in :mod:`.math_answer`.
"""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
PREFIX = "refusion_"

#: The reference's task name (eval.sh) -> ours.
PAPER_TASKS = {
    name: PREFIX + name
    for name in ("gsm8k_cot", "minerva_math", "mbpp", "humaneval_instruct_noprefix", "gpqa_main_generative_n_shot",
                 "arc_challenge_chat", "mmlu_pro")
}


def task_names() -> list[str]:
    """The seven task (or group) names."""
    return list(PAPER_TASKS.values())
