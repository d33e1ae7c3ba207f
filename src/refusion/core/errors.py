"""Errors raised in more than one layer, defined below all of them so that no module imports another
only for an exception class."""

from __future__ import annotations


class MaskTokenError(ValueError):
    """The model/tokenizer has no mask token (raised where one is needed: a diffusion decoder, a family
    that requires one)."""
