"""Autoregressive greedy decoding with a KV cache: the ARM baseline (Qwen3-style).

One prefill forward of the prompt yields the first token (logits of the last position only); then one
1-token forward per further token, until an EOS or ``gen_length`` tokens. Equal to transformers' greedy
``generate`` on the same model. The token stays on the device between steps; one host read per token
decides whether it was an EOS.

Batched (:meth:`~refusion.core.interfaces.Decoder.generate_batch`): the prompts are left-padded to one
width (each keeps its own positions; padding is masked out of every key row), one prefill serves all,
then one ``[b, 1]`` forward per step for the b sequences still decoding: a sequence that emits EOS or
reaches ``gen_length`` leaves the batch (its cache row is dropped). One host read per step.
"""

from __future__ import annotations

import time

import torch

from refusion.core.host import from_host, to_host
from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Decoder, DecoderOptions
from refusion.core.types import IterationTrace, LoopOutput
from refusion.decoders.common import additive_mask, left_pad

LAST = slice(-1, None)


class ArDecoder(Decoder):
    name = "ar"
    Options = DecoderOptions
    attention = ("causal",)
    batched = True

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

    def _decode_batch(self, prompts, generator):
        bb = self.backbone
        dev, dtype, B = bb.device, bb.model.dtype, len(prompts)
        ids, pos, key_real = left_pad(prompts, bb.eos_id, dev)  # [B, W] each
        W = ids.shape[1]
        causal = torch.ones(W, W, dtype=torch.bool, device=dev).tril()
        allowed = (causal[None] & key_real[:, None, :]) | torch.eye(W, dtype=torch.bool, device=dev)  # [B, W, W]
        cache = bb.new_cache()
        logits = bb.forward(ids, pos, cache, attn_mask=additive_mask(allowed, dtype), logits_at=LAST)  # [B, 1, V]
        generated: list[list[int]] = [[] for _ in prompts]
        nfe, fed = [1] * B, [W] * B
        finished_at: list[float | None] = [None] * B
        rows = list(range(B))  # the sequence each cache row belongs to
        while True:
            token = logits.argmax(-1)  # [b, 1] on the device
            (values,) = to_host(token)  # the one host read per step
            keep = []
            for r, seq in enumerate(rows):
                generated[seq].append(values[r][0])
                if generated[seq][-1] in bb.eos_ids or len(generated[seq]) >= self.options.gen_length:
                    finished_at[seq] = time.perf_counter()
                else:
                    keep.append(r)
            if not keep:
                break
            if len(keep) < len(rows):  # the finished sequences leave the batch
                index = from_host(keep, dev)
                bb.select(cache, keep)
                token, key_real = token[index], key_real[index]
                rows = [rows[r] for r in keep]
            step_pos = from_host([[len(prompts[seq]) + len(generated[seq]) - 1] for seq in rows], dev)  # [b, 1]
            key_real = torch.cat([key_real, torch.ones(len(rows), 1, dtype=torch.bool, device=dev)], dim=1)
            logits = bb.forward(token, step_pos, cache, attn_mask=additive_mask(key_real[:, None, :], dtype),
                                logits_at=LAST)
            for seq in rows:
                nfe[seq] += 1
                fed[seq] += 1
        outs = []
        for seq, prompt in enumerate(prompts):
            out, P = generated[seq], len(prompt)
            trace = [IterationTrace(block=0, stage="ar", scored=[], chosen=[P + i], accepted=[(P + i, 1)], forwards=1)
                     for i in range(len(out))]
            outs.append(LoopOutput(out, trace, list(prompt) + out, list(range(P + len(out))), nfe=nfe[seq],
                                   tokens_in=fed[seq], finished_at=finished_at[seq]))
        return outs


@hookimpl
def register_decoders(register):
    register("ar", ArDecoder)
