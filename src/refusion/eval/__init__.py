"""Evaluation with lm-evaluation-harness: the ``refusion`` harness model, tinybench as local harness tasks,
and ``refusion eval`` (also ``accelerate launch -m refusion.eval ...`` for data-parallel runs).

Importing this package is cheap; :mod:`refusion.eval.lm_eval_adapter` imports ``lm_eval`` (the ``eval``
extra: ``pip install 'refusion[eval]'``).
"""

from __future__ import annotations

from refusion.eval.tasks import write_lm_eval_tasks

__all__ = ["write_lm_eval_tasks"]
