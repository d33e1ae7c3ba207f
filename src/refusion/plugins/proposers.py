"""Built-in proposers of the ``speculative`` decoder (:class:`~refusion.core.interfaces.Proposer`).

* ``ngram``: prompt lookup, with transformers' ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``
  semantics (``PromptLookupCandidateGenerator``): for n = max_matching_ngram_size down to 1, the leftmost
  earlier occurrence in prompt + output of the context's last n tokens whose continuation is not empty;
  that continuation (at most k tokens, up to the context's end) is proposed, cut before its first EOS.
  No match: nothing is proposed (the verification is a plain AR step). No model, no forwards.
* ``model``: a small AR draft model (``tiny-ar-draft`` by default; same tokenizer as the target) decodes k
  tokens after the context, one forward each, on its own KV cache (the context's tokens it has not seen
  are fed with the first of them); after verification its cache is cropped to the accepted prefix.
  Greedy at temperature 0, sampled from softmax(logits / T) above (its distributions go to the rejection
  rule). The k steps keep each token on the device: no host read.
* ``diffusion``: a masked or block diffusion model (``tiny-mdm``, ``tiny-block``) fills k [MASK]s after the
  context in ONE forward: the context's new tokens causally (so their KV never changes and is cached),
  the k masks seeing the whole context and each other; the masks' KV is dropped again. The idea of
  DFlash (a block-diffusion drafter for speculative decoding) without its conditioning on the target's
  hidden features: the drafter sees only tokens.
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

import torch
from pydantic import Field

from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host
from refusion.core.interfaces import Draft, Options, Proposer, ProposerState
from refusion.core.loop import Attention, ForwardRequest
from refusion.core.probs import row_argmax, tempered_softmax

LAST = slice(-1, None)
DRAFT = "draft"  # the request group of a drafter's forwards: never in one model call with the target's


def lookup(context: list[int], k: int, max_ngram: int, eos_ids: set[int]) -> list[int]:
    """Prompt lookup over ``context`` (transformers' ``PromptLookupCandidateGenerator.get_candidates``)."""
    L = len(context)
    for size in range(min(max_ngram, L - 1), 0, -1):
        tail = context[L - size:]
        first = tail[0]
        for i in range(L - size + 1):  # left to right: the first match with a continuation wins
            if context[i] != first or context[i:i + size] != tail:
                continue
            start, end = i + size, min(i + size + k, L)
            if start < end:
                chosen = context[start:end]
                for j, t in enumerate(chosen):
                    if t in eos_ids:
                        return chosen[:j]
                return chosen
    return []


class NgramProposer(Proposer):
    class Options(Options):
        max_matching_ngram_size: int = Field(2, ge=1, le=64, description="longest n-gram matched (transformers' "
                                             "max_matching_ngram_size); k plays prompt_lookup_num_tokens")

    eos_ids: set[int] = set()

    def bind(self, backbone):
        bound = type(self)(self.options)
        bound.eos_ids, bound.device = set(backbone.eos_ids), backbone.device
        return bound

    def start(self, prompt_ids, cache=None):
        return ProposerState()

    def propose(self, state, context, k, temperature, generator):
        chosen = lookup(context, k, self.options.max_matching_ngram_size, self.eos_ids)
        return Draft(from_host(chosen, self.device, torch.long), len(chosen))


@lru_cache(maxsize=4)
def _load(name: str, device: str, dtype: torch.dtype, compile: str | None = None):
    from refusion.models.backend import Backbone

    return Backbone.from_pretrained(name, device=device, dtype=dtype, compile=compile)


class _DraftModelProposer(Proposer):
    """A proposer that runs a model of its own: loads it on the target's device and dtype at :meth:`bind`
    (or takes a :class:`~refusion.models.backend.Backbone` given to :meth:`with_backbone`) and checks that
    the two share a vocabulary."""

    draft = None  # the drafter's Backbone
    draft_attention: ClassVar[str] = "causal"  # the attention of the draft model (refusion.testing's checks use it)

    def with_backbone(self, draft) -> "_DraftModelProposer":
        """This proposer with ``draft`` (a Backbone) as its model, instead of loading ``options.model``."""
        bound = type(self)(self.options)
        bound.draft = draft
        return bound

    def bind(self, backbone):
        bound = self if self.draft is not None else self.with_backbone(
            _load(self.options.model, str(backbone.device), backbone.model.dtype, getattr(backbone, "compile", None)))
        if isinstance(self, DiffusionProposer) and bound.draft.logits_shifted:
            raise ValueError(f"proposer {self.options.model!r}: a drafter with shifted logits (Dream-style) is not "
                             "supported yet")
        v_draft, v_target = bound.draft.model.config.vocab_size, backbone.model.config.vocab_size
        if v_draft != v_target:
            raise ValueError(f"proposer {self.options.model!r} has a vocabulary of {v_draft} tokens, the target "
                             f"{v_target}: a draft model must share the target's tokenizer")
        return bound

    def start(self, prompt_ids, cache=None):
        return ProposerState(cache=cache if cache is not None else self.draft.new_cache())

    def new_batch_cache(self):
        from refusion.models.kvcache import RaggedCache

        return RaggedCache(self.draft)

    def _sample(self, logits, temperature, generator):
        """``logits [m, V]`` -> (tokens [m], their distributions [m, V] or None at temperature 0)."""
        if temperature == 0:
            return row_argmax(logits), None
        q = tempered_softmax(logits, temperature)
        return torch.multinomial(q, 1, generator=generator)[:, 0], q


class ModelProposer(_DraftModelProposer):
    class Options(Options):
        model: str = Field("tiny-ar-draft", description="the draft model: a shipped checkpoint name or a folder")

    def propose(self, state, context, k, temperature, generator):
        cache = state.cache
        held = cache.length()  # the draft cache holds context[:held]
        ids = from_host(context[held:], self.draft.device, torch.long)  # [m]: the context's unseen tokens
        pos = torch.arange(held, len(context))
        tokens, probs = [], []
        for i in range(k):
            logits = yield ForwardRequest(cache, ids, pos, logits_at=LAST, group=DRAFT)  # [1, 1, V]
            state.forwards += 1
            token, q = self._sample(logits[0], temperature, generator)  # [1], [1, V]
            tokens.append(token)
            probs.append(q)
            ids, pos = token, torch.tensor([len(context) + i])
        # the cache now holds context + d_1 .. d_{k-1}
        return Draft(torch.cat(tokens), k, None if temperature == 0 else torch.cat(probs))

    def accept(self, state, context, accepted):
        state.cache.crop(min(state.cache.length(), len(context) - 1))  # context minus the target's token, at most


class DiffusionProposer(_DraftModelProposer):
    draft_attention = "bidirectional"

    class Options(Options):
        model: str = Field("tiny-block", description="a masked / block diffusion model with the target's tokenizer "
                           "(tiny-mdm, tiny-block)")

    def propose(self, state, context, k, temperature, generator):
        cache = state.cache
        held = cache.length()
        m = len(context) - held  # context tokens the draft cache has not seen
        ids = torch.cat([from_host(context[held:], self.draft.device, torch.long),
                         torch.full((k,), self.draft.mask_id, dtype=torch.long, device=self.draft.device)])  # [m + k]
        pos = torch.arange(held, len(context) + k)
        segments = list(range(m)) + [m] * k  # context causal, the masks one segment after it
        logits = yield ForwardRequest(cache, ids, pos, logits_at=slice(m, None), group=DRAFT,
                                      attention=Attention.block_causal(segments))  # [1, k, V]
        state.forwards += 1
        cache.crop(len(context))  # the masks' KV goes
        tokens, q = self._sample(logits[0], temperature, generator)
        return Draft(tokens, k, q)


@hookimpl
def register_proposers(register):
    register("ngram", NgramProposer)
    register("model", ModelProposer)
    register("diffusion", DiffusionProposer)
