"""Loading a model folder of any family: LLaDA and Dream natively (:mod:`refusion.models.native`, no
remote code), every other family through transformers' auto classes, with remote code only when
allowed. :meth:`refusion.models.backend.Backbone.from_pretrained` loads through :func:`load_model`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refusion.models import native as native_models
from refusion.models.families import (
    Family, FamilyError, adapt_model, auto_class, needs_remote_code, read_config, uses_native,
)

if TYPE_CHECKING:
    from refusion.models.loading import Runtime


def load_model(
    path: str | os.PathLike, family: Family, runtime: "Runtime | None" = None, trust_remote_code: bool = False,
    native: bool | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` of ``family`` from a local folder as ``runtime`` says (default:
    ``Runtime.resolve()``, float32 / sdpa on the CPU); remote code only when allowed. LLaDA and Dream
    load natively (:mod:`refusion.models.native`, no remote code) unless ``trust_remote_code`` is given
    or ``native=False``; ``native=True`` loads natively even with ``trust_remote_code``. Flash attention
    is refused for families that attend through 4D masks (bidirectional, block-causal)."""
    from transformers import AutoConfig, AutoTokenizer

    from refusion.models.loading import Runtime, check_model_dir

    runtime = runtime if runtime is not None else Runtime.resolve()
    path = Path(path)
    check_model_dir(path)
    raw = read_config(path)
    if uses_native(family, trust_remote_code, native):
        _refuse_flash(runtime, family, remote=False)
        model = native_models.load_native_model(path, family, runtime=runtime)
        return runtime.place(model), native_models.load_native_tokenizer(path, family)
    remote = needs_remote_code(raw, family)
    if remote and not trust_remote_code:
        code = sorted(p.name for p in path.glob("*.py")) or ["(none found)"]
        raise FamilyError(
            f"{family.name!r} models run their own modeling code ({', '.join(code)} in {str(path)!r}); "
            "it is only loaded with --trust-remote-code (trust_remote_code=True). Read that code first: "
            "it runs with your permissions"
            + (" (or load it natively, without remote code: native=True)" if family.native else "")
        )
    _refuse_flash(runtime, family, remote)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    model = auto_class(raw).from_pretrained(
        path, config=config, trust_remote_code=trust_remote_code, local_files_only=True,
        **runtime.from_pretrained_kwargs(remote_code=remote),
    )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    return adapt_model(runtime.place(model), family), tokenizer


def _refuse_flash(runtime: "Runtime", family: Family, remote: bool) -> None:
    """Flash attention takes no 4D mask: refused for families that attend through one (unless remote code
    attends its own way)."""
    from refusion.models.loading import RuntimeOptionError, attn_implementations_here

    if runtime.attn_implementation == "flash_attention_2" and family.attention != "causal" and not remote:
        allowed = [a for a in attn_implementations_here(True, runtime.dtype) if a != "flash_attention_2"]
        raise RuntimeOptionError(
            "attn_implementation", runtime.attn_implementation,
            f"{family.name!r} models attend {family.attention.replace('_', '-')} through 4D masks, which flash "
            f"attention does not take; allowed here: {', '.join(allowed)}")
