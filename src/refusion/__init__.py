"""refusion: decode, train and compare diffusion language models (ReFusion and its rivals).

The Python quickstart (docs/quickstart.md)::

    from refusion import Backbone, build_decoder, encode_prompt, get_task

    model = Backbone.from_pretrained("tiny-refusion")              # a shipped checkpoint or a local folder
    decoder = build_decoder(model, {"decoder": "refusion", "slot_size": 8, "gen_length": 64})
    example = get_task("facts").examples("test", 1)[0]
    result = decoder.generate(encode_prompt(model.tokenizer, example.query))
    print(result.text, result.stats.tpf, get_task("facts").score(example, result.text))
    # the tiny models answer tinybench prompts only; arith and code need gen_length 128 (docs/quickstart.md)

Names are loaded on first use, so ``import refusion`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "Backbone": "refusion.models.backend",
    "build_decoder": "refusion.core.config",
    "validate_config": "refusion.core.config",
    "load_config_file": "refusion.core.config",
    "encode_prompt": "refusion.models.tokenizer",
    "get_task": "refusion.tasks",
    "Decoder": "refusion.core.interfaces",
    "DecodeResult": "refusion.core.types",
    "DecodeStats": "refusion.core.types",
    "get_registry": "refusion.core.registry",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from refusion.core.config import build_decoder, load_config_file, validate_config
    from refusion.core.interfaces import Decoder
    from refusion.core.registry import get_registry
    from refusion.core.types import DecodeResult, DecodeStats
    from refusion.models.backend import Backbone
    from refusion.models.tokenizer import encode_prompt
    from refusion.tasks import get_task


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'refusion' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
