"""Torch CPU threads of a command: one ``--threads`` flag, one default, one place that applies it.

torch's own default, one thread per core, spin-waits beside any other busy process: on the 2-core
development machine, beside a one-thread training job, arith AR decodes took a median 4.19 s against
0.15 s with one thread (docs/bench.md#threads). So every command that decodes defaults to
:data:`DECODE_DEFAULT` (1) thread; ``--threads N`` asks for N, ``--threads auto`` for the physical cores
less the one-minute load average (at least 1). ``scripts/thread_default.py`` measures the candidates
quiet and beside a busy process.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from refusion.core.config import ConfigError

DECODE_DEFAULT = 1  # torch threads of a decoding command without --threads
AUTO = "auto"


def physical_cores() -> int:
    """Physical CPU cores (distinct core ids of /proc/cpuinfo); ``os.cpu_count()`` where it cannot tell."""
    try:
        cores, physical = set(), "0"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                physical = value.strip()
            elif key.strip() == "core id":
                cores.add((physical, value.strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def auto_threads() -> int:
    """The physical cores less the one-minute load average (rounded), at least 1."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, physical_cores() - round(load))


def resolve_threads(value: int | str | None, default: int | None = DECODE_DEFAULT) -> int | None:
    """``--threads`` as a count: an integer of at least 1, ``auto`` (:func:`auto_threads`), or None for
    ``default`` (None: torch's own default). A :class:`ConfigError` names ``--threads`` otherwise."""
    if value is None:
        value = default
    if value is None:
        return None
    if str(value).strip().lower() == AUTO:
        return auto_threads()
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--threads: expected a number of threads or 'auto', got {value!r}") from None
    if count < 1:
        raise ConfigError(f"--threads: must be at least 1, got {count}")
    return count


def set_threads(value: int | str | None, default: int | None = DECODE_DEFAULT) -> int:
    """Give torch :func:`resolve_threads` ``(value, default)`` CPU threads; return the count in use."""
    import torch

    count = resolve_threads(value, default)
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()


def add_threads_arg(p: argparse.ArgumentParser, default: int | None = DECODE_DEFAULT) -> None:
    """``--threads N|auto`` on ``p``; its value is applied by :func:`set_threads` with the same ``default``."""
    p.add_argument("--threads", default=None, metavar="N|auto",
                   help=f"torch CPU threads: N, or 'auto' (physical cores less the load average); default "
                        f"{default}{', which does not slow down beside another busy process' if default == 1 else ''}"
                        " (torch's own default, one per core, spin-waits beside one)")
