"""The one place hypothesis is imported, with a clear error when it is missing."""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
    from hypothesis import strategies as st  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "refusion.testing's strategies and checks need hypothesis, which is not installed; "
        "install the extra: pip install 'refusion[testing]' (or pip install hypothesis)"
    ) from e
