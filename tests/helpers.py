"""Test helpers. The character tokenizer, tiny random Qwen3 models and the logits hooks live in
:mod:`refusion.testing.models` (installed, for plugin authors too) and are re-exported here."""

from __future__ import annotations

import torch

from refusion.testing.models import (  # noqa: F401  (moved to the installed package; imported from here by tests)
    CHARS, SPECIALS, ban_token, force_token, kept_rows, make_char_tokenizer, make_tiny_qwen3,
)

MICRO_SENTENCE = "the quick brown fox sees "  # the micro_refusion fixture's fixed response head


def chosen(mask: torch.Tensor) -> list[int]:
    """Indices where a selector's ``[n]`` bool mask is True."""
    return mask.nonzero().flatten().tolist()


class StrayReads:
    """Counts tensor-to-Python conversions (the points where a GPU would synchronise) made outside the
    model's forward and outside :func:`refusion.core.host.to_host`; ``where`` lists each one's caller."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")

    def __init__(self, model) -> None:
        self.model, self.where, self._inside = model, [], 0

    def __enter__(self) -> "StrayReads":
        import sys

        self._saved = {name: getattr(torch.Tensor, name) for name in self.METHODS}
        self._saved_getitem = torch.Tensor.__getitem__
        model_forward = self.model.forward

        def inside_model(*args, **kwargs):
            self._inside += 1
            try:
                return model_forward(*args, **kwargs)
            finally:
                self._inside -= 1

        self.model.forward = inside_model

        def note(name):
            caller = sys._getframe(2)
            if not self._inside and caller.f_globals.get("__name__") != "refusion.core.host":
                self.where.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")

        def wrap(name, original):
            def patched(t, *args, **kwargs):
                note(name)
                return original(t, *args, **kwargs)
            return patched

        for name, original in self._saved.items():
            setattr(torch.Tensor, name, wrap(name, original))
        getitem = self._saved_getitem

        def patched_getitem(t, index):
            items = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                note("boolean-mask indexing")
            return getitem(t, index)

        torch.Tensor.__getitem__ = patched_getitem
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        torch.Tensor.__getitem__ = self._saved_getitem
        del self.model.forward


def decode_reading_host(backbone, config: dict, prompt: list[int] | list[list[int]]):
    """Decode ``prompt`` (a list of prompts: as one batch, ``generate_batch``); return the result (the
    list of results), the host reads (``to_host`` calls), the ``tolist`` calls (``to_host`` makes one per
    read) and every other tensor-to-Python conversion made outside the model."""
    from refusion.core import host
    from refusion.core.config import build_decoder

    decoder = build_decoder(backbone, config)
    watched, tolist_calls = torch.Tensor.tolist, [0]

    def counted(t, *args, **kwargs):
        tolist_calls[0] += 1
        return watched(t, *args, **kwargs)

    torch.Tensor.tolist = counted  # beneath StrayReads' own patch, which names the caller
    host.reset()
    try:
        with StrayReads(backbone.model) as stray:
            if prompt and isinstance(prompt[0], list):
                result = decoder.generate_batch(prompt)
            else:
                result = decoder.generate(prompt)
    finally:
        torch.Tensor.tolist = watched
    return result, host.count, tolist_calls[0], stray.where


def task_prompt(tokenizer, task: str, idx: int = 0, split: str = "test") -> list[int]:
    """Token ids of tinybench ``task``'s sample ``idx``, encoded as the bench encodes it."""
    from refusion.models.tokenizer import encode_prompt
    from refusion.tasks import get_task

    return encode_prompt(tokenizer, get_task(task).examples(split, idx + 1)[idx].query)


def assert_batch_decodes_as_alone(batch, alone, atol: float = 1e-5) -> None:
    """Each result of a batch equals its decode alone: token ids, every iteration's chosen positions and
    block, the positions scored and (within ``atol``) their scores."""
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [[t.chosen for t in r.trace] for r in batch] == [[t.chosen for t in r.trace] for r in alone]
    assert [[t.block for t in r.trace] for r in batch] == [[t.block for t in r.trace] for r in alone]
    for b, a in zip(batch, alone):
        for tb, ta in zip(b.trace, a.trace):
            assert [p for p, _ in tb.scored] == [p for p, _ in ta.scored]
            assert torch.allclose(torch.tensor([s for _, s in tb.scored]), torch.tensor([s for _, s in ta.scored]),
                                  atol=atol)


def endless_backbone(path: str):
    """A backbone whose model never ends a text (no EOS ids): a decode runs its whole max_tokens (the serve
    tests' long decodes; picklable by name, so an engine process can load it)."""
    from refusion.models.backend import Backbone

    bb = Backbone.from_pretrained(path)
    bb.eos_ids = set()
    return bb


def decode_eager_and_compiled(tokenizer, attention: str, config: dict, compile_mode: str):
    """Decode three random prompts alone and as a batch with ``config`` on a tiny Qwen3, eager and under
    ``--compile compile_mode`` (the same weights); assert the same token ids and forwards; -> the compiled
    Backbone."""
    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone

    model = make_tiny_qwen3(len(tokenizer), attention=attention)
    eager, compiled = Backbone(model, tokenizer), Backbone(model, tokenizer, compile=compile_mode)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in (5, 9, 3)]
    cfg = {**config, "gen_length": 16}
    want, got = build_decoder(eager, cfg), build_decoder(compiled, cfg)
    assert [got.generate(p).token_ids for p in prompts] == [want.generate(p).token_ids for p in prompts]
    assert [r.token_ids for r in got.generate_batch(prompts)] == [r.token_ids for r in want.generate_batch(prompts)]
    assert compiled.nfe == eager.nfe  # the same forwards, counted the same way
    return compiled
