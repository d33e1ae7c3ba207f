"""Property-based checks for parts and decoders, built-in or third-party: hypothesis strategies, tiny models
built in seconds, and one check per part kind that runs the kind's documented contract (reorder and
position invariance where it applies).

>>> from refusion.testing import check_scorer, check_decoder
>>> check_scorer(MyScorer)          # a class, or a registered name
>>> check_decoder("refusion")       # every registered part, yours included, inside the decoder

:mod:`refusion.testing.models` (tokenizer, tiny Qwen3 models, ban/force hooks) needs only the package;
the strategies and checks need hypothesis (``pip install 'refusion[testing]'``) and import it on first use.
"""

from __future__ import annotations

from typing import Any

_CHECKS = ("ContractError", "CheckReport", "CHECKS", "CONTRACTS", "check_scorer", "check_selector", "check_verifier",
           "check_extender", "check_cache_manager", "check_remasker", "check_drafter", "check_proposer",
           "check_acceptance", "check_decoder",
           "check_part", "decoder_invariants")

__all__ = [*_CHECKS, "strategies", "models"]


def __getattr__(name: str) -> Any:
    if name in _CHECKS:
        import refusion.testing.checks as checks

        return getattr(checks, name)
    if name in ("strategies", "models", "checks"):
        import importlib

        return importlib.import_module(f"refusion.testing.{name}")
    raise AttributeError(f"module 'refusion.testing' has no attribute {name!r}")
