"""Autoregressive greedy decoding with a KV cache: the ARM baseline (Qwen3-style).

One prefill forward of the prompt yields the first token; then one 1-token forward per further token,
until an EOS or ``gen_length`` tokens. Equal to transformers' greedy ``generate`` on the same model.
"""

from __future__ import annotations

import torch

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Decoder, DecoderOptions
from refusion.core.types import IterationTrace, LoopOutput


class ArDecoder(Decoder):
    name = "ar"
    Options = DecoderOptions
    attention = ("causal",)

    def _decode(self, prompt_ids, generator):
        bb = self.backbone
        cache = bb.new_cache()
        P = len(prompt_ids)
        logits = bb.forward(torch.tensor(prompt_ids), torch.arange(P), cache)[0, -1]
        out: list[int] = []
        trace: list[IterationTrace] = []
        while True:
            tok = int(logits.argmax())
            out.append(tok)
            trace.append(IterationTrace(block=0, stage="ar", scored=[], chosen=[P + len(out) - 1],
                                        accepted=[(P + len(out) - 1, 1)], forwards=1))
            if tok in bb.eos_ids or len(out) >= self.options.gen_length:
                break
            pos = P + len(out) - 1
            logits = bb.forward(torch.tensor([tok]), torch.tensor([pos]), cache)[0, -1]
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))))


@hookimpl
def register_decoders(register):
    register("ar", ArDecoder)
