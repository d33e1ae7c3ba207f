"""pluggy hook specifications of refusion (project name and entry-point group: ``refusion``).

Every hook takes a ``register`` callback, as in simonw/llm: an implementation calls
``register(name, cls)`` once per part it provides. Built-in parts use these hooks exactly as a
third-party package does; a package exposes its module under the entry-point group ``refusion``::

    [project.entry-points.refusion]
    my_scorers = "my_package.scorers"

and that module defines e.g. ``@hookimpl def register_scorers(register): register("mine", MyScorer)``.
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "refusion"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, type], None]


@hookspec
def register_decoders(register: Register) -> None:
    """Register decoding loops (subclasses of :class:`refusion.core.interfaces.Decoder`)."""


@hookspec
def register_scorers(register: Register) -> None:
    """Register confidence scorers (subclasses of :class:`refusion.core.interfaces.Scorer`)."""


@hookspec
def register_drafters(register: Register) -> None:
    """Register drafters (subclasses of :class:`refusion.core.interfaces.Drafter`)."""


@hookspec
def register_selectors(register: Register) -> None:
    """Register slot selectors (subclasses of :class:`refusion.core.interfaces.Selector`)."""


@hookspec
def register_verifiers(register: Register) -> None:
    """Register verifiers (subclasses of :class:`refusion.core.interfaces.Verifier`)."""


@hookspec
def register_extenders(register: Register) -> None:
    """Register Stage II-b extenders (subclasses of :class:`refusion.core.interfaces.Extender`)."""


@hookspec
def register_caches(register: Register) -> None:
    """Register cache managers (subclasses of :class:`refusion.core.interfaces.CacheManager`)."""


@hookspec
def register_remaskers(register: Register) -> None:
    """Register remaskers (subclasses of :class:`refusion.core.interfaces.Remasker`)."""


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers (subclasses of :class:`refusion.core.interfaces.Proposer`)."""


@hookspec
def register_acceptance_rules(register: Register) -> None:
    """Register speculative-decoding acceptance rules (subclasses of :class:`refusion.core.interfaces.AcceptanceRule`)."""


@hookspec
def register_objectives(register: Register) -> None:
    """Register training objectives (subclasses of :class:`refusion.core.objective.Objective`)."""
