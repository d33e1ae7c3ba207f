"""Autoregressive greedy decoding with a KV cache: the ARM baseline (Qwen3-style).

One prefill forward of the prompt yields the first token (logits of the last position only); then one
1-token forward per further token, until an EOS or ``gen_length`` tokens. Equal to transformers' greedy
``generate`` on the same model. The token stays on the device between steps; one host read per token
decides whether it was an EOS.
"""

from __future__ import annotations

import torch

from refusion.core.host import to_host
from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Decoder, DecoderOptions
from refusion.core.types import IterationTrace, LoopOutput

LAST = slice(-1, None)


class ArDecoder(Decoder):
    name = "ar"
    Options = DecoderOptions
    attention = ("causal",)

    def _decode(self, prompt_ids, generator):
        bb = self.backbone
        cache = bb.new_cache()
        P = len(prompt_ids)
        logits = bb.forward(torch.tensor(prompt_ids), torch.arange(P), cache, logits_at=LAST)  # [1, 1, V]
        out: list[int] = []
        trace: list[IterationTrace] = []
        while True:
            token = logits.argmax(-1)  # [1, 1] on the device
            out.append(to_host(token)[0][0][0])  # the one host read per token: EOS or not
            pos = P + len(out) - 1
            trace.append(IterationTrace(block=0, stage="ar", scored=[], chosen=[pos], accepted=[(pos, 1)], forwards=1))
            if out[-1] in bb.eos_ids or len(out) >= self.options.gen_length:
                break
            logits = bb.forward(token, torch.tensor([[pos]]), cache, logits_at=LAST)
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))))


@hookimpl
def register_decoders(register):
    register("ar", ArDecoder)
