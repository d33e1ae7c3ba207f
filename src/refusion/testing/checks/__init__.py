"""One check per part kind, and one per decoder: each runs that kind's documented contract as hypothesis
properties and raises :class:`ContractError` naming every property that failed, with its failing example.

>>> from refusion.testing import check_scorer
>>> check_scorer(MyScorer)                     # or check_scorer("my_scorer"): a registered name

Each ``check_<kind>(cls_or_name, options=None, max_examples=None)`` draws the part's options from its
``Options`` model unless ``options`` (a mapping or an ``Options`` instance) fixes them, and runs
``max_examples`` examples per property (None: the environment variable ``REFUSION_CHECK_EXAMPLES`` if set,
else the active hypothesis profile's, 100 by default; the project's test suite registers ``ci`` = 25 and
``thorough`` = 1,000). The contracts, kind by kind, are listed in :data:`CONTRACTS` and in
docs/reliability.md.

The checks live by part kind in this package's modules (:mod:`~refusion.testing.checks.slots`: scorer,
selector, verifier, extender, remasker, drafter; :mod:`~refusion.testing.checks.cache`;
:mod:`~refusion.testing.checks.speculative`: proposer, acceptance; :mod:`~refusion.testing.checks.decoder`)
over what :mod:`~refusion.testing.checks.base` shares; every name is importable from here.
"""

from __future__ import annotations

from typing import Any, Callable

from refusion.testing.checks.base import (ATOL, CONTRACTS, CheckReport, ContractError, _run,  # noqa: F401
                                          _settings, backbone)
from refusion.testing.checks.slots import (check_drafter, check_extender, check_remasker,  # noqa: F401
                                           check_scorer, check_selector, check_verifier, threshold_fields)
from refusion.testing.checks.cache import check_cache_manager  # noqa: F401
from refusion.testing.checks.speculative import bind_proposer, check_acceptance, check_proposer  # noqa: F401
from refusion.testing.checks.decoder import check_decoder, decoder_invariants  # noqa: F401

#: kind -> its check
CHECKS: dict[str, Callable[..., CheckReport]] = {
    "scorer": check_scorer, "selector": check_selector, "verifier": check_verifier, "extender": check_extender,
    "cache": check_cache_manager, "remasker": check_remasker, "drafter": check_drafter,
    "proposer": check_proposer, "acceptance": check_acceptance,
}


def check_part(kind: str, cls_or_name, options=None, max_examples: int | None = None, **kw: Any) -> CheckReport:
    """The check of ``kind`` (``decoder`` included) on a class or registered name."""
    if kind == "decoder":
        return check_decoder(cls_or_name, max_examples, **kw)
    if kind not in CHECKS:
        raise ValueError(f"no check for part kind {kind!r}; checked kinds: {', '.join([*CHECKS, 'decoder'])}")
    return CHECKS[kind](cls_or_name, options, max_examples, **kw)
