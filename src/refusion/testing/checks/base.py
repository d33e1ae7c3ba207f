"""What every check shares: the report and error types, the contract register (:data:`CONTRACTS`), the
hypothesis settings and property runner, option and part resolution, tensor comparisons and the tiny backbone
the model-driven checks build once per process."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from refusion.testing._hypothesis import st
import refusion.testing.strategies as S

ATOL = 1e-5


class ContractError(AssertionError):
    """A part or decoder broke its kind's contract; the message names each failed property with the
    example hypothesis found (shrunk) and what was expected."""


@dataclass
class CheckReport:
    """What a check ran: the part, the properties that held and those that failed (with their messages)."""

    kind: str
    name: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def message(self) -> str:
        lines = [f"{self.kind} {self.name} breaks {len(self.failed)} of its contract's "
                 f"{len(self.passed) + len(self.failed)} properties:"]
        for statement, detail in self.failed:
            lines.append(f"\n- {statement}\n" + "\n".join("    " + line for line in detail.splitlines()))
        return "\n".join(lines)


#: kind -> the statements its check runs (one hypothesis property each); docs/reliability.md lists them
CONTRACTS: dict[str, list[str]] = {}


def _contract(kind: str, statement: str):
    CONTRACTS.setdefault(kind, []).append(statement)
    return statement


def _settings(max_examples: int | None):
    from hypothesis import HealthCheck, settings

    base = settings()
    max_examples = max_examples or int(os.environ.get("REFUSION_CHECK_EXAMPLES") or 0) or base.max_examples
    return settings(base, max_examples=max_examples, deadline=None, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


def _run(report: CheckReport, properties: list[tuple[str, Callable, dict]], max_examples: int | None,
         raise_on_failure: bool) -> CheckReport:
    """Run each ``(statement, body, strategies)`` as a hypothesis property; record failures readably."""
    from hypothesis import given

    for statement, body, strategies in properties:
        test = _settings(max_examples)(given(**strategies)(body))
        try:
            test()
        except Exception as e:  # noqa: BLE001 - a part may raise anything; report it with its example
            notes = [n.strip("\n") for n in getattr(e, "__notes__", []) if "reproduce_failure" not in n]
            what = str(e) if isinstance(e, AssertionError) else f"raised {type(e).__name__}: {e}"
            report.failed.append((statement, "\n".join([what.strip() or type(e).__name__, *notes])))
        else:
            report.passed.append(statement)
    if raise_on_failure and report.failed:
        raise ContractError(report.message())
    return report


def _resolve(kind: str, cls_or_name, registry=None) -> tuple[type, str]:
    if isinstance(cls_or_name, str):
        from refusion.core.registry import get_registry

        return (registry or get_registry()).get(kind, cls_or_name), cls_or_name
    return cls_or_name, f"{cls_or_name.__module__}.{cls_or_name.__qualname__}"


def _options(cls, options, none: bool = True):
    """A strategy of ``cls.Options``: drawn, or the one given."""
    if options is None:
        return S.part_options(cls, none=none)
    if isinstance(options, dict):
        options = cls.Options.model_validate(options)
    return st.just(options)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=ATOL, rtol=1e-5, equal_nan=False)


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor], what: str) -> None:
    for b, a in zip(before, after):
        assert torch.equal(b, a), f"{what} modified its input tensor in place"


@functools.lru_cache(maxsize=None)
def backbone(attention: str = "causal", seed: int = 3, layers: int = 2):
    """A tiny random backbone of ``attention``, built once per process (checks share it)."""
    from refusion.testing.models import tiny_backbone

    return tiny_backbone(attention, seed=seed, layers=layers)
