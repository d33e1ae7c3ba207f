"""Autoregressive greedy decoding with a KV cache: the ARM baseline (Qwen3-style).

One prefill forward of the prompt yields the first token (logits of the last position only); then one
1-token forward per further token, until an EOS or ``gen_length`` tokens. Equal to transformers' greedy
``generate`` on the same model. The token stays on the device between steps; one host read per token
decides whether it was an EOS.

Batched (:meth:`~refusion.core.interfaces.Decoder.generate_batch`): the same loop per sequence, run by
:func:`~refusion.core.loop.run_loops` over one :class:`~refusion.models.kvcache.RaggedCache`: one
prefill forward serves every prompt (each row its own length), then one ``[b, 1]`` forward per step for
the b sequences still decoding; a sequence that emits EOS or reaches ``gen_length`` leaves the batch
(its cache row is dropped). One host read per step for the whole batch.
"""

from __future__ import annotations

import torch

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import DecoderOptions
from refusion.core.loop import Commit, ForwardRequest, LoopSteps, Read
from refusion.core.probs import row_argmax
from refusion.core.types import IterationTrace, LoopOutput
from refusion.decoders.common import LoopDecoder

LAST = slice(-1, None)


class ArDecoder(LoopDecoder):
    name = "ar"
    Options = DecoderOptions
    attention = ("causal",)

    def _loop(self, prompt_ids, generator, cache) -> LoopSteps:
        """One sequence's decode on ``cache``; yields its forwards, host reads and one commit per token."""
        bb = self.backbone
        P = len(prompt_ids)
        logits = yield ForwardRequest(cache, torch.tensor(prompt_ids), torch.arange(P), logits_at=LAST)  # [1, 1, V]
        out: list[int] = []
        trace: list[IterationTrace] = []
        while True:
            token = row_argmax(logits)  # [1, 1] on the device
            (value,) = yield Read((token,))  # the one host read per token: EOS or not
            out.append(value[0][0])
            pos = P + len(out) - 1
            yield Commit([pos], [out[-1]])
            trace.append(IterationTrace(block=0, stage="ar", scored=[], chosen=[pos], accepted=[(pos, 1)], forwards=1))
            if out[-1] in bb.eos_ids or len(out) >= self.options.gen_length:
                break
            logits = yield ForwardRequest(cache, token, torch.tensor([[pos]]), logits_at=LAST)
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))))


@hookimpl
def register_decoders(register):
    register("ar", ArDecoder)
