"""Built-in training objectives: ``ar``, ``refusion``, ``mdm``, ``block`` (registered through the hook).

Every objective puts targets so that ``labels[j]`` is predicted by the logits at position ``j``
(see :mod:`refusion.core.objective`). Layouts, per example (``P`` prompt tokens, ``R`` response
tokens including the final EOS):

``ar`` (causal)
    ``prompt + response``; ``labels[j] = input[j+1]`` for the positions ``P-1 .. P+R-2`` (every response
    token is predicted from its left context); mean CE over those labels. 2D attention mask.

``refusion`` (causal, re-ordered buffer; the reference's ``forward_process``)
    see :func:`refusion_layout`. ``loss = loss_ar + loss_mdm`` with ``loss_ar`` = mean CE over all
    clean-slot labels of the batch and ``loss_mdm`` = sum over masked tokens of
    ``CE / p_mask / R`` divided by the batch size. 2D attention mask, explicit permuted position ids.

``mdm`` (bidirectional; LLaDA's SFT objective)
    the response is right-padded with EOS to the longest response of the batch (LLaDA's SFT, option
    ``eos_pad``; those EOS count as answer tokens and are masked/predicted like any other);
    ``t ~ U(0,1)``, ``p_mask = (1-eps) t + eps``, each response token replaced by ``[MASK]`` with
    probability ``p_mask``; ``loss = sum(CE / p_mask / answer_length) / B`` over masked tokens. The
    attention mask is 4D additive: every token attends to every non-pad token. Logits at a ``[MASK]``
    predict the token at that same position.

``block`` (block-causal; BD3-LM's vectorised training)
    the response is right-padded with EOS to a multiple of ``block_size`` (option ``pad_to_block``) and
    split into blocks; each block b draws its own ``t_b`` and masks its tokens with probability
    ``p_b``. The buffer is ``prompt + noisy blocks 0..n-1 + clean blocks 0..n-2`` (the clean copy of the
    last block is never attended to, so it is left out) with ORIGINAL position ids for both copies.
    Attention (4D additive mask):

    - a prompt token attends to the whole prompt (bidirectional within the prompt);
    - a noisy token of block b attends to the prompt, the CLEAN copies of blocks < b and every noisy
      token of block b;
    - a clean token of block b attends to the prompt and the clean copies of blocks <= b.

    Loss on the masked noisy tokens: ``sum(CE / p_b / answer_length) / B``. This is exactly what a
    decoder sees when it (1) prefills the prompt with full attention inside the prompt, (2) for each
    block forwards the block's tokens ([MASK] or already decoded) on top of the cache with an all-ones
    mask (cache + the whole block), logits at a [MASK] predicting that position, and (3) once a block
    is finished forwards its clean tokens once more on top of the cache with an all-ones mask and
    keeps that KV. In short: every decoder forward attends to everything in the cache plus the whole
    chunk being forwarded.

Why one module of about 480 lines: the four objectives register together as one plugin module (the
hook returns them all) and share the masking and layout helpers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.masks import additive_mask
from refusion.core.objective import IGNORE, Batch, Objective, Pair, Targets


# --------------------------------------------------------------------------------------------
# pure layout functions (property-tested)
# --------------------------------------------------------------------------------------------
def refusion_layout(
    prompt_ids: list[int],
    response_ids: list[int],
    slot_size: int,
    masked_slots: list[bool],
    order: list[int],
    mask_id: int,
) -> dict[str, list]:
    """The ReFusion training layout of one example (the reference's ``forward_process``).

    ``response_ids`` (EOS included) is cut into slots of ``slot_size`` tokens (the last may be shorter);
    ``masked_slots[s]`` says whether slot ``s`` is masked; ``order`` lists the CLEAN slot indices in the
    order they are placed (a permutation of the unmasked slots). Returns lists of equal length
    ``len(prompt) + len(response)``:

    - ``input_ids``: prompt, then the clean slots in ``order``, then ``[MASK]`` for every token of the
      masked slots, masked slots in their original order;
    - ``position_ids``: the ORIGINAL position of each token (prompt ``0..P-1``, response ``P+i``);
    - ``labels``: -100 on the prompt; in a clean slot ``labels[j] = token[j+1]`` of the same slot and -100
      on the slot's last token; in a masked slot the original token at that position (no shift);
    - ``masked``: True on the ``[MASK]`` positions.
    """
    if slot_size < 1:
        raise ValueError("slot_size must be >= 1")
    n_slots = math.ceil(len(response_ids) / slot_size)
    if len(masked_slots) != n_slots:
        raise ValueError(f"masked_slots has {len(masked_slots)} entries for {n_slots} slots")
    clean = [s for s in range(n_slots) if not masked_slots[s]]
    if sorted(order) != clean:
        raise ValueError("order must be a permutation of the unmasked slot indices")
    P = len(prompt_ids)
    input_ids = list(prompt_ids)
    position_ids = list(range(P))
    labels = [IGNORE] * P
    masked = [False] * P
    for s in order:
        toks = response_ids[s * slot_size:(s + 1) * slot_size]
        input_ids += toks
        position_ids += [P + s * slot_size + i for i in range(len(toks))]
        labels += toks[1:] + [IGNORE]
        masked += [False] * len(toks)
    for s in range(n_slots):
        if not masked_slots[s]:
            continue
        toks = response_ids[s * slot_size:(s + 1) * slot_size]
        input_ids += [mask_id] * len(toks)
        position_ids += [P + s * slot_size + i for i in range(len(toks))]
        labels += list(toks)
        masked += [True] * len(toks)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "masked": masked}


def block_layout(
    prompt_ids: list[int],
    response_ids: list[int],
    block_size: int,
    masked_tokens: list[bool],
    mask_id: int,
) -> dict[str, list]:
    """The vectorised block-diffusion layout of one example (see the module docstring).

    Returns lists for ``prompt + noisy response + clean blocks 0..n-2``: ``input_ids``, ``position_ids``,
    ``labels`` (original token at masked noisy positions, -100 elsewhere), ``masked``, ``kind``
    (0 prompt, 1 noisy, 2 clean) and ``block`` (block index; -1 on the prompt).
    """
    R = len(response_ids)
    if len(masked_tokens) != R:
        raise ValueError("masked_tokens must have one flag per response token")
    P = len(prompt_ids)
    n_blocks = math.ceil(R / block_size)
    n_clean = min(R, (n_blocks - 1) * block_size)
    resp_pos = list(range(P, P + R))
    resp_blk = [i // block_size for i in range(R)]
    noisy = [mask_id if m else t for t, m in zip(response_ids, masked_tokens)]
    return {
        "input_ids": list(prompt_ids) + noisy + list(response_ids[:n_clean]),
        "position_ids": list(range(P)) + resp_pos + resp_pos[:n_clean],
        "labels": [IGNORE] * P + [t if m else IGNORE for t, m in zip(response_ids, masked_tokens)] + [IGNORE] * n_clean,
        "masked": [False] * P + list(masked_tokens) + [False] * n_clean,
        "kind": [0] * P + [1] * R + [2] * n_clean,
        "block": [-1] * P + resp_blk + resp_blk[:n_clean],
    }


def block_attention_allowed(kind: Tensor, block: Tensor, valid: Tensor) -> Tensor:
    """``[L, L]`` bool: may query ``q`` attend to key ``k`` (block layout; pad rows see themselves)."""
    kq, kk = kind[:, None], kind[None, :]
    bq, bk = block[:, None], block[None, :]
    prompt_key = kk == 0
    allowed = torch.where(
        kq == 0, prompt_key,
        torch.where(
            kq == 1,
            prompt_key | ((kk == 1) & (bk == bq)) | ((kk == 2) & (bk < bq)),
            prompt_key | ((kk == 2) & (bk <= bq)),
        ),
    )
    allowed = allowed & valid[None, :] & valid[:, None]
    eye = torch.eye(len(kind), dtype=torch.bool)
    return allowed | (eye & ~valid[:, None])


def _pad(rows: list[list[int]], value: int, length: int) -> list[list[int]]:
    return [r + [value] * (length - len(r)) for r in rows]


def _pad_positions(rows: list[list[int]], length: int) -> list[list[int]]:
    """Right-pad position rows, continuing after each row's largest position."""
    out = []
    for r in rows:
        start = (max(r) + 1) if r else 0
        out.append(r + list(range(start, start + length - len(r))))
    return out


def _p_mask(t: float, eps: float) -> float:
    return (1.0 - eps) * t + eps


def _masked_metrics(logits: Tensor, targets: Targets) -> dict[str, float]:
    m = targets.masked
    n = int(m.sum())
    if n == 0:
        return {"masked_acc": float("nan"), "n_masked": 0.0}
    pred = logits[m].argmax(-1)
    acc = (pred == targets.labels[m]).float().mean().item()
    return {"masked_acc": acc, "n_masked": float(n)}


def _diffusion_loss(logits: Tensor, targets: Targets, n_examples: int) -> Tensor:
    labels = torch.where(targets.masked, targets.labels, torch.full_like(targets.labels, IGNORE))
    return (Objective.token_ce(logits, labels) * targets.weights).sum() / max(n_examples, 1)


# --------------------------------------------------------------------------------------------
# objectives
# --------------------------------------------------------------------------------------------
class ArObjective(Objective):
    """Next-token prediction on the response tokens (prompt ignored), causal attention."""

    name = "ar"  # causal attention, no [MASK] predictions and no options: Objective's defaults

    def make_batch(self, pairs: list[Pair], generator: torch.Generator) -> Batch:
        ids, pos, lab = [], [], []
        for prompt, response in pairs:
            seq = list(prompt) + list(response)
            P = len(prompt)
            labels = [IGNORE] * len(seq)
            for j in range(max(P - 1, 0), len(seq) - 1):
                labels[j] = seq[j + 1]
            ids.append(seq)
            pos.append(list(range(len(seq))))
            lab.append(labels)
        L = max(len(r) for r in ids)
        attn = [[1] * len(r) + [0] * (L - len(r)) for r in ids]
        B = len(pairs)
        return Batch(
            input_ids=torch.tensor(_pad(ids, self.pad_id, L)),
            position_ids=torch.tensor(_pad_positions(pos, L)),
            attention_mask=torch.tensor(attn),
            labels=torch.tensor(_pad(lab, IGNORE, L)),
            masked=torch.zeros(B, L, dtype=torch.bool),
            weights=torch.zeros(B, L),
            n_examples=B,
        )

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        logits, targets = self.label_logits(model, batch)
        valid = targets.labels != IGNORE
        ce = self.token_ce(logits, targets.labels)
        n = valid.sum().clamp(min=1)
        loss = ce.sum() / n
        acc = (logits[valid].argmax(-1) == targets.labels[valid]).float().mean().item() if valid.any() else float("nan")
        return loss, {"loss": loss.item(), "acc": acc}


class RefusionObjective(Objective):
    """The ReFusion hybrid objective, exactly as the reference's ``forward_process`` + loss."""

    name = "refusion"
    attention = "causal"
    diffusion = True

    class Options(Objective.Options):
        slot_sizes: list[int] = Field(default_factory=lambda: [4, 8, 16, 32])
        eps: float = 1e-3

        @field_validator("slot_sizes")
        @classmethod
        def _positive(cls, v: list[int]) -> list[int]:
            if not v or any(k < 1 for k in v):
                raise ValueError("slot_sizes must be a non-empty list of positive integers")
            return v

    def sample_layout(self, prompt: list[int], response: list[int], generator: torch.Generator) -> tuple[dict, float]:
        sizes = self.options.slot_sizes
        k = sizes[int(torch.randint(len(sizes), (1,), generator=generator))]
        t = float(torch.rand(1, generator=generator, dtype=torch.float64))
        p = _p_mask(t, self.options.eps)
        n_slots = math.ceil(len(response) / k)
        masked = (torch.rand(n_slots, generator=generator, dtype=torch.float64) < p).tolist()
        clean = [s for s in range(n_slots) if not masked[s]]
        perm = torch.randperm(len(clean), generator=generator).tolist()
        order = [clean[i] for i in perm]
        lay = refusion_layout(prompt, response, k, masked, order, self.mask_id)
        lay["slot_size"] = k
        return lay, p

    def make_batch(self, pairs: list[Pair], generator: torch.Generator) -> Batch:
        ids, pos, lab, msk, wts, slot_sizes, pm = [], [], [], [], [], [], []
        for prompt, response in pairs:
            lay, p = self.sample_layout(list(prompt), list(response), generator)
            w = 1.0 / (p * len(response))
            ids.append(lay["input_ids"])
            pos.append(lay["position_ids"])
            lab.append(lay["labels"])
            msk.append(lay["masked"])
            wts.append([w if m else 0.0 for m in lay["masked"]])
            slot_sizes.append(lay["slot_size"])
            pm.append(p)
        L = max(len(r) for r in ids)
        B = len(pairs)
        return Batch(
            input_ids=torch.tensor(_pad(ids, self.pad_id, L)),
            position_ids=torch.tensor(_pad_positions(pos, L)),
            attention_mask=torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in ids]),
            labels=torch.tensor(_pad(lab, IGNORE, L)),
            masked=torch.tensor([m + [False] * (L - len(m)) for m in msk]),
            weights=torch.tensor([w + [0.0] * (L - len(w)) for w in wts], dtype=torch.float32),
            n_examples=B,
            meta={"slot_sizes": slot_sizes, "p_mask": pm},
        )

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        logits, targets = self.label_logits(model, batch)
        ce = self.token_ce(logits, targets.labels)
        ar_mask = (targets.labels != IGNORE) & ~targets.masked
        n_ar = int(ar_mask.sum())
        loss_ar = (ce * ar_mask).sum() / n_ar if n_ar else ce.sum() * 0.0
        loss_mdm = (ce * targets.weights * targets.masked).sum() / max(batch.n_examples, 1)
        loss = loss_ar + loss_mdm
        metrics = {"loss": loss.item(), "loss_ar": loss_ar.item(), "loss_mdm": loss_mdm.item()}
        metrics.update(_masked_metrics(logits, targets))
        if n_ar:
            metrics["ar_acc"] = (logits[ar_mask].argmax(-1) == targets.labels[ar_mask]).float().mean().item()
        return loss, metrics


class MaskedDiffusionObjective(Objective):
    """Shared loss of the masked-diffusion objectives: 1/p_mask-weighted CE on masked positions."""

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        logits, targets = self.label_logits(model, batch)
        loss = _diffusion_loss(logits, targets, batch.n_examples)
        metrics = {"loss": loss.item()}
        metrics.update(_masked_metrics(logits, targets))
        return loss, metrics


class MdmObjective(MaskedDiffusionObjective):
    """LLaDA-style masked diffusion: bidirectional attention, per-token Bernoulli(p_mask) masking."""

    name = "mdm"
    attention = "bidirectional"
    diffusion = True
    # LLaDA's EOS padding teaches where an answer ends only when a batch mixes lengths: on tinybench train,
    # length-grouped batches (group 64) pad a response with 5.0 EOS on average, random batches with 69.8
    wants_random_batches = True

    class Options(Objective.Options):
        eps: float = 1e-3
        #: right-pad responses with EOS to the batch's longest response (LLaDA SFT)
        eos_pad: bool = True
        #: share of examples masked as a semi-autoregressive decode sees them (0: LLaDA's SFT alone)
        semi_ar: float = Field(default=0.0, ge=0.0, le=1.0)
        #: the block length of those examples (the decoder's ``block_length``)
        semi_ar_block: int = Field(default=32, ge=1)
        #: share of those examples whose block is masked from a uniformly drawn position on (its earlier
        #: tokens clean), as a left-to-right decode of the block sees it, instead of token by token
        semi_ar_suffix: float = Field(default=0.0, ge=0.0, le=1.0)
        #: Dream's shifted targets: the logits at position i predict token i + 1, at [MASK] inputs too, so a
        #: model adapted from an autoregressive one keeps its next-token head (recorded in the checkpoint's
        #: ``refusion_logits_shifted``; the LLaDA-style decoder shifts its logits back)
        shift: bool = False

    def make_batch(self, pairs: list[Pair], generator: torch.Generator) -> Batch:
        R_max = max(len(r) for _, r in pairs)
        ids, lab, msk, wts, pm = [], [], [], [], []
        for prompt, response in pairs:
            response = list(response)
            if self.options.eos_pad:
                response = response + [self.eos_id] * (R_max - len(response))
            t = float(torch.rand(1, generator=generator, dtype=torch.float64))
            p = _p_mask(t, self.options.eps)
            masked = (torch.rand(len(response), generator=generator, dtype=torch.float64) < p).tolist()
            scored, span = masked, len(response)
            if self.options.semi_ar and float(torch.rand(1, generator=generator, dtype=torch.float64)) < self.options.semi_ar:
                masked, scored, span, p = self._semi_ar_layout(masked, p, generator)
            P = len(prompt)
            ids.append(list(prompt) + [self.mask_id if m else tok for tok, m in zip(response, masked)])
            lab.append([IGNORE] * P + [tok if m else IGNORE for tok, m in zip(response, scored)])
            msk.append([False] * P + scored)
            w = 1.0 / (p * span)  # each example's weights sum to 1 in expectation
            wts.append([0.0] * P + [w if m else 0.0 for m in scored])
            pm.append(p)
            if self.options.shift:  # the target of position j is read at position j - 1
                lab[-1], msk[-1], wts[-1] = lab[-1][1:] + [IGNORE], msk[-1][1:] + [False], wts[-1][1:] + [0.0]
        L = max(len(r) for r in ids)
        B = len(pairs)
        valid = torch.tensor([[True] * len(r) + [False] * (L - len(r)) for r in ids])
        allowed = valid[:, None, :].expand(B, L, L) | torch.eye(L, dtype=torch.bool)[None]
        return Batch(
            input_ids=torch.tensor(_pad(ids, self.pad_id, L)),
            position_ids=torch.arange(L).expand(B, L).clone(),
            attention_mask=additive_mask(allowed)[:, None],
            labels=torch.tensor(_pad(lab, IGNORE, L)),
            masked=torch.tensor([m + [False] * (L - len(m)) for m in msk]),
            weights=torch.tensor([w + [0.0] * (L - len(w)) for w in wts], dtype=torch.float32),
            n_examples=B,
            meta={"p_mask": pm, "n_tokens": int(valid.sum())},
        )

    def _semi_ar_layout(self, masked: list[bool], p: float, generator: torch.Generator) -> tuple[list[bool], list[bool], int, float]:
        """What a semi-autoregressive decode shows at a step of block ``b`` (drawn uniformly): blocks before
        ``b`` clean, block ``b`` masked as drawn (``masked``; with probability ``semi_ar_suffix`` from a
        uniformly drawn position to its end instead), every later token ``[MASK]``. Returns the input's
        mask, the scored targets (block ``b``'s masked tokens only: the decoder commits nothing beyond its
        block), the block's length and its share of masked tokens (``p`` unless masked as a suffix)."""
        L = self.options.semi_ar_block
        n_blocks = -(-len(masked) // L)
        start = L * int(torch.randint(n_blocks, (1,), generator=generator))
        end = min(start + L, len(masked))
        if self.options.semi_ar_suffix and float(torch.rand(1, generator=generator, dtype=torch.float64)) < self.options.semi_ar_suffix:
            cut = start + int(torch.randint(end - start, (1,), generator=generator))
            masked = [j >= cut for j in range(len(masked))]
            p = (end - cut) / (end - start)
        elif not any(masked[start:end]):  # at least one target in the block
            masked = masked[:start] + [True] + masked[start + 1:]
        in_block = [start <= j < end for j in range(len(masked))]
        shown = [j >= end or (b and m) for j, (b, m) in enumerate(zip(in_block, masked))]
        return shown, [b and m for b, m in zip(in_block, masked)], end - start, p


class BlockObjective(MaskedDiffusionObjective):
    """Block diffusion (BD3-LM vectorised training): noisy block b attends to clean blocks < b."""

    name = "block"
    attention = "block_causal"
    diffusion = True

    class Options(Objective.Options):
        block_size: int = Field(default=8, ge=1)
        eps: float = 1e-3
        #: right-pad responses with EOS to a multiple of block_size (every block full)
        pad_to_block: bool = True

    def make_batch(self, pairs: list[Pair], generator: torch.Generator) -> Batch:
        bs = self.options.block_size
        rows: list[dict] = []
        wts: list[list[float]] = []
        for prompt, response in pairs:
            response = list(response)
            if self.options.pad_to_block and len(response) % bs:
                response += [self.eos_id] * (bs - len(response) % bs)
            n_blocks = math.ceil(len(response) / bs)
            ts = torch.rand(n_blocks, generator=generator, dtype=torch.float64).tolist()
            ps = [_p_mask(t, self.options.eps) for t in ts]
            u = torch.rand(len(response), generator=generator, dtype=torch.float64).tolist()
            masked = [u[i] < ps[i // bs] for i in range(len(response))]
            lay = block_layout(list(prompt), response, bs, masked, self.mask_id)
            rows.append(lay)
            P = len(prompt)
            R = len(response)
            w = [0.0] * len(lay["input_ids"])
            for i in range(R):
                if masked[i]:
                    w[P + i] = 1.0 / (ps[i // bs] * R)
            wts.append(w)
        L = max(len(r["input_ids"]) for r in rows)
        B = len(pairs)
        masks = []
        n_tokens = 0
        for r in rows:
            n = len(r["input_ids"])
            n_tokens += n
            kind = torch.tensor(r["kind"] + [3] * (L - n))
            block = torch.tensor(r["block"] + [-2] * (L - n))
            valid = torch.arange(L) < n
            masks.append(additive_mask(block_attention_allowed(kind, block, valid)))
        return Batch(
            input_ids=torch.tensor(_pad([r["input_ids"] for r in rows], self.pad_id, L)),
            position_ids=torch.tensor(_pad_positions([r["position_ids"] for r in rows], L)),
            attention_mask=torch.stack(masks)[:, None],
            labels=torch.tensor(_pad([r["labels"] for r in rows], IGNORE, L)),
            masked=torch.tensor([r["masked"] + [False] * (L - len(r["masked"])) for r in rows]),
            weights=torch.tensor([w + [0.0] * (L - len(w)) for w in wts], dtype=torch.float32),
            n_examples=B,
            meta={"n_tokens": n_tokens, "kind": [r["kind"] for r in rows]},
        )

OBJECTIVES: dict[str, type[Objective]] = {
    "ar": ArObjective,
    "refusion": RefusionObjective,
    "mdm": MdmObjective,
    "block": BlockObjective,
}


@hookimpl
def register_objectives(register: Any) -> None:
    for name, cls in OBJECTIVES.items():
        register(name, cls)
