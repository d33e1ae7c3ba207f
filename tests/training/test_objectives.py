"""Objectives: batch layouts (property tests), attention masks, losses on micro models."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DynamicCache, PreTrainedTokenizerFast

from refusion.models.build import build_model
from refusion.plugins.objectives import (
    OBJECTIVES,
    BlockObjective,
    MdmObjective,
    RefusionObjective,
    refusion_layout,
    register_objectives,
)
from refusion.core.objective import IGNORE, Objective

torch.set_num_threads(2)
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|beginoftext|>", "<|mask|>"]
MASK = 3
TEXTS = [
    "Ava has 3 * 12 = 36 pens.", "Ben has 25 + 14 = 39 pens.", "How many pens do they have in total?",
    "def add(a, b):\n    return a + b", "The capital of France is Paris.", "Total: 36 + 39 = 75.\n#### 75",
]


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(TEXTS * 3, tr)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token=SPECIAL[0], pad_token=SPECIAL[1],
                                   bos_token=SPECIAL[2], mask_token=SPECIAL[3])


@pytest.fixture(scope="module")
def pairs(tok):
    from refusion.training.data import encode_pair

    qs = ["Ava buys 3 bags of 12 pens. How many?", "Write add.", "Capital of France?", "Ben has 25 pens."]
    rs = ["Ava has 3 * 12 = 36 pens.\n#### 36", "def add(a, b):\n    return a + b", "Paris.", TEXTS[5]]
    return [encode_pair(tok, q, r) for q, r in zip(qs, rs)]


# ------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------
def test_hook_registers_all_four():
    got = {}
    register_objectives(register=lambda name, cls: got.__setitem__(name, cls))
    assert set(got) == {"ar", "refusion", "mdm", "block"}
    for name, cls in got.items():
        assert issubclass(cls, Objective) and cls.name == name
    assert OBJECTIVES["mdm"].attention == "bidirectional"
    assert OBJECTIVES["block"].attention == "block_causal"
    assert OBJECTIVES["refusion"].attention == OBJECTIVES["ar"].attention == "causal"


def test_options_forbid_unknown_keys():
    with pytest.raises(Exception):
        RefusionObjective(mask_id=3, pad_id=1, eos_id=0, options={"slot_size": 4})
    o = RefusionObjective(mask_id=3, pad_id=1, eos_id=0, options={"slot_sizes": [2, 4]})
    assert o.options.slot_sizes == [2, 4] and o.options.eps == 1e-3
    assert BlockObjective(mask_id=3, pad_id=1, eos_id=0, block_size=4).options.block_size == 4


# ------------------------------------------------------------------------------------------
# refusion layout (pure function, property-tested)
# ------------------------------------------------------------------------------------------
@st.composite
def layouts(draw):
    P = draw(st.integers(0, 6))
    R = draw(st.integers(1, 40))
    k = draw(st.integers(1, 9))
    n_slots = math.ceil(R / k)
    masked = draw(st.lists(st.booleans(), min_size=n_slots, max_size=n_slots))
    clean = [s for s in range(n_slots) if not masked[s]]
    order = draw(st.permutations(clean))
    prompt = draw(st.lists(st.integers(10, 99), min_size=P, max_size=P))
    response = draw(st.lists(st.integers(10, 99), min_size=R, max_size=R))
    return prompt, response, k, masked, list(order)


@pytest.mark.property
@given(layouts())
def test_refusion_layout_invariants(case):
    """For any prompt, response length, slot size, slot mask and order of the clean slots, the layout
    is the reference's: the prompt first and unlabelled; every response token appears exactly once
    (as an input or as a masked label); position ids are a permutation of the original positions;
    clean slots come first in the given order, each contiguous with its own positions and labelled with
    the next token of the same slot (its last token ignored); masked slots follow in original order,
    labelled with the token at their own position. This is what lets one causal forward train the
    next-token and the masked-slot predictions of the decoder at once (refusion-algorithm.md)."""
    prompt, response, k, masked, order = case
    lay = refusion_layout(prompt, response, k, masked, order, MASK)
    P, R = len(prompt), len(response)
    ids, pos, lab, msk = lay["input_ids"], lay["position_ids"], lay["labels"], lay["masked"]
    assert len(ids) == len(pos) == len(lab) == len(msk) == P + R
    # prompt first, untouched, labels ignored
    assert ids[:P] == prompt and pos[:P] == list(range(P)) and lab[:P] == [IGNORE] * P
    # position ids are a permutation of the original positions
    assert sorted(pos) == list(range(P + R))
    original = {P + i: t for i, t in enumerate(response)}
    seen = {}
    for j in range(P, P + R):
        p = pos[j]
        if msk[j]:
            assert ids[j] == MASK and lab[j] == original[p]  # masked label = original token there
            seen[p] = lab[j]
        else:
            assert ids[j] == original[p]  # clean token sits at its own position id
            seen[p] = ids[j]
    # every response token appears exactly once, either as input or as a masked label
    assert seen == original
    # clean slots (in `order`) come before every masked token; masked slots in original order
    n_clean_tok = sum(min(k, R - s * k) for s in order)
    assert not any(msk[P:P + n_clean_tok]) and all(msk[P + n_clean_tok:])
    masked_pos = pos[P + n_clean_tok:]
    assert masked_pos == sorted(masked_pos)
    # clean slots appear in `order`, each contiguous with increasing positions
    j = P
    for s in order:
        size = min(k, R - s * k)
        assert pos[j:j + size] == list(range(P + s * k, P + s * k + size))
        # label[j] = next token of the same slot, last token of the slot ignored
        assert lab[j:j + size] == response[s * k:s * k + size][1:] + [IGNORE]
        j += size


def test_refusion_layout_example():
    lay = refusion_layout([5, 6], [10, 11, 12, 13, 14], 2, [False, True, False], [2, 0], MASK)
    assert lay["input_ids"] == [5, 6, 14, 10, 11, MASK, MASK]
    assert lay["position_ids"] == [0, 1, 6, 2, 3, 4, 5]
    assert lay["labels"] == [IGNORE, IGNORE, IGNORE, 11, IGNORE, 12, 13]
    assert lay["masked"] == [False] * 5 + [True, True]
    with pytest.raises(ValueError):
        refusion_layout([5], [10, 11], 1, [False, False], [0], MASK)  # order misses slot 1


def test_refusion_batch(pairs):
    obj = RefusionObjective(mask_id=MASK, pad_id=1, eos_id=0)
    b = obj.make_batch(pairs, torch.Generator().manual_seed(0))
    B, L = b.input_ids.shape
    assert B == len(pairs) and L == max(len(p) + len(r) for p, r in pairs)
    assert b.attention_mask.shape == (B, L)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        assert b.attention_mask[i, :n].all() and not b.attention_mask[i, n:].any()
        assert (b.input_ids[i, n:] == 1).all() and (b.labels[i, n:] == IGNORE).all()
        pos = b.position_ids[i].tolist()
        assert sorted(pos[:n]) == list(range(n)) and pos[n:] == list(range(n, L))  # padding continues
        w = b.weights[i][b.masked[i]]
        if len(w):
            assert torch.allclose(w, torch.full_like(w, 1.0 / (b.meta["p_mask"][i] * len(r))))
        assert b.meta["slot_sizes"][i] in (4, 8, 16, 32)
    # same generator state -> same batch
    b2 = obj.make_batch(pairs, torch.Generator().manual_seed(0))
    assert torch.equal(b.input_ids, b2.input_ids) and torch.equal(b.position_ids, b2.position_ids)


def test_refusion_loss_matches_hand_computation(tok, pairs):
    torch.manual_seed(0)
    model = build_model(tok, "micro")
    obj = RefusionObjective.from_tokenizer(tok, slot_sizes=[2])
    b = obj.make_batch(pairs, torch.Generator().manual_seed(3))
    loss, metrics = obj.loss(model, b)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask,
                       use_cache=False).logits
    ar_terms, mdm = [], 0.0
    for i, (p, r) in enumerate(pairs):
        for j in range(b.input_ids.shape[1]):
            y = int(b.labels[i, j])
            if y == IGNORE:
                continue
            ce = -torch.log_softmax(logits[i, j], -1)[y].item()
            if b.masked[i, j]:
                mdm += ce / b.meta["p_mask"][i] / len(r)
            else:
                ar_terms.append(ce)
    want_ar = sum(ar_terms) / len(ar_terms)
    want = want_ar + mdm / len(pairs)
    assert metrics["loss_ar"] == pytest.approx(want_ar, rel=1e-4)
    assert loss.item() == pytest.approx(want, rel=1e-4)


# ------------------------------------------------------------------------------------------
# attention masks
# ------------------------------------------------------------------------------------------
def test_mdm_mask_is_bidirectional(tok, pairs):
    obj = MdmObjective.from_tokenizer(tok)
    b = obj.make_batch(pairs, torch.Generator().manual_seed(0))
    B, L = b.input_ids.shape
    assert b.attention_mask.shape == (B, 1, L, L) and b.attention_mask.dtype == torch.float32
    R_max = max(len(r) for _, r in pairs)
    for i, (p, _) in enumerate(pairs):
        n = len(p) + R_max  # responses are EOS-padded to the longest response
        allowed = b.attention_mask[i, 0] == 0
        assert allowed[:n, :n].all()  # everyone sees everyone (incl. later tokens)
        assert not allowed[:n, n:].any()  # nobody sees padding
        assert (b.input_ids[i, len(p):n][~b.masked[i, len(p):n]] != tok.mask_token_id).all()
        assert b.labels[i, :len(p)].eq(IGNORE).all()
    # the model really is bidirectional under this mask: the first logits react to the last token
    model = build_model(tok, "micro")
    b1 = obj.make_batch(pairs[:1], torch.Generator().manual_seed(0))
    ids2 = b1.input_ids.clone()
    ids2[0, -1] = 7 if int(ids2[0, -1]) != 7 else 8
    with torch.no_grad():
        l1 = model(input_ids=b1.input_ids, position_ids=b1.position_ids, attention_mask=b1.attention_mask).logits
        l2 = model(input_ids=ids2, position_ids=b1.position_ids, attention_mask=b1.attention_mask).logits
    assert (l1[0, 0] - l2[0, 0]).abs().max() > 1e-4


def test_mdm_semi_ar_layout(tok, pairs):
    """``semi_ar=1``: every example shows earlier blocks clean, its block partly masked, the rest [MASK];
    only the block's masked tokens are targets, weighted to sum to ~1 per example. ``semi_ar=0`` draws
    exactly LLaDA's layout."""
    block = 4
    obj = MdmObjective.from_tokenizer(tok, {"semi_ar": 1.0, "semi_ar_block": block})
    R_max = max(len(r) for _, r in pairs)
    mask_id = tok.mask_token_id
    starts = set()
    for seed in range(20):
        b = obj.make_batch(pairs, torch.Generator().manual_seed(seed))
        for i, (p, r) in enumerate(pairs):
            P = len(p)
            shown = b.input_ids[i, P:P + R_max] == mask_id  # [R_max]
            scored = b.masked[i, P:P + R_max]
            where = scored.nonzero().flatten()
            assert len(where) >= 1
            start = int(where[0]) // block * block
            end = min(start + block, R_max)
            starts.add(start)
            assert not shown[:start].any()  # earlier blocks clean
            assert shown[end:].all()  # later tokens all [MASK]
            assert (scored == (shown & (torch.arange(R_max) >= start) & (torch.arange(R_max) < end))).all()
            padded = list(r) + [tok.eos_token_id] * (R_max - len(r))
            assert b.labels[i, P:P + R_max][scored].tolist() == [padded[j] for j in where.tolist()]
            assert b.labels[i, P:P + R_max][~scored].eq(IGNORE).all()
            w = b.weights[i, P:P + R_max]
            assert torch.allclose(w[scored], torch.full_like(w[scored], 1.0 / (b.meta["p_mask"][i] * (end - start))))
    assert len(starts) > 2  # the block is drawn, not fixed
    plain = MdmObjective.from_tokenizer(tok).make_batch(pairs, torch.Generator().manual_seed(3))
    off = MdmObjective.from_tokenizer(tok, {"semi_ar": 0.0}).make_batch(pairs, torch.Generator().manual_seed(3))
    assert torch.equal(plain.input_ids, off.input_ids) and torch.equal(plain.weights, off.weights)


def test_mdm_semi_ar_suffix_masks_the_block_from_a_drawn_position(tok, pairs):
    """``semi_ar_suffix=1``: the block is clean up to a drawn position and [MASK] from there, every later
    token [MASK]; each example's weights sum to exactly 1. ``semi_ar_suffix=0`` draws as before."""
    block = 4
    obj = MdmObjective.from_tokenizer(tok, {"semi_ar": 1.0, "semi_ar_block": block, "semi_ar_suffix": 1.0})
    R_max = max(len(r) for _, r in pairs)
    cuts = set()
    for seed in range(20):
        b = obj.make_batch(pairs, torch.Generator().manual_seed(seed))
        for i, (p, _) in enumerate(pairs):
            P = len(p)
            shown = (b.input_ids[i, P:P + R_max] == tok.mask_token_id).tolist()
            scored = b.masked[i, P:P + R_max]
            cut = shown.index(True)
            end = min(cut // block * block + block, R_max)
            cuts.add(cut % block)
            assert all(shown[cut:])  # one run of [MASK] from the cut to the end
            assert scored.nonzero().flatten().tolist() == list(range(cut, end))
            assert abs(float(b.weights[i].sum()) - 1.0) < 1e-5
    assert len(cuts) > 2  # the cut is drawn inside the block
    before = MdmObjective.from_tokenizer(tok, {"semi_ar": 1.0, "semi_ar_block": block})
    off = MdmObjective.from_tokenizer(tok, {"semi_ar": 1.0, "semi_ar_block": block, "semi_ar_suffix": 0.0})
    a, c = (o.make_batch(pairs, torch.Generator().manual_seed(3)) for o in (before, off))
    assert torch.equal(a.input_ids, c.input_ids) and torch.equal(a.weights, c.weights)


def test_mdm_shift_moves_targets_one_left(tok, pairs):
    """``shift``: the same draw, each target read one position earlier (Dream's shifted logits), so the
    answer's first token is scored at the prompt's last position; the input is unchanged."""
    for options in ({}, {"semi_ar": 1.0, "semi_ar_block": 4}):
        plain = MdmObjective.from_tokenizer(tok, options).make_batch(pairs, torch.Generator().manual_seed(5))
        shifted = MdmObjective.from_tokenizer(tok, {**options, "shift": True}).make_batch(
            pairs, torch.Generator().manual_seed(5))
        assert torch.equal(plain.input_ids, shifted.input_ids)
        assert torch.equal(plain.attention_mask, shifted.attention_mask)
        for name in ("labels", "masked", "weights"):
            a, b = getattr(plain, name), getattr(shifted, name)
            assert torch.equal(a[:, 1:], b[:, :-1]), name
            assert not b[:, -1].ne({"labels": IGNORE, "masked": False, "weights": 0.0}[name]).any(), name
        P = len(pairs[0][0])
        if plain.masked[0, P]:
            assert shifted.masked[0, P - 1] and shifted.labels[0, P - 1] == pairs[0][1][0]


def test_block_layout_and_mask(tok, pairs):
    bs = 4
    obj = BlockObjective.from_tokenizer(tok, block_size=bs)
    b = obj.make_batch(pairs, torch.Generator().manual_seed(0))
    for i, (p, r) in enumerate(pairs):
        P = len(p)
        R = math.ceil(len(r) / bs) * bs  # EOS-padded to whole blocks
        nb = R // bs
        n = P + R + (nb - 1) * bs
        kind = b.meta["kind"][i]
        assert kind == [0] * P + [1] * R + [2] * ((nb - 1) * bs)
        pos = b.position_ids[i, :n].tolist()
        assert pos[P:P + R] == list(range(P, P + R)) and pos[P + R:n] == list(range(P, P + (nb - 1) * bs))
        resp = r + [tok.eos_token_id] * (R - len(r))
        assert b.input_ids[i, P + R:n].tolist() == resp[:(nb - 1) * bs]  # clean copy
        allowed = b.attention_mask[i, 0] == 0
        for q in range(n):
            for k in range(n):
                if kind[q] == 0:
                    want = kind[k] == 0
                elif kind[q] == 1:
                    bq = (q - P) // bs
                    want = kind[k] == 0 or (kind[k] == 1 and (k - P) // bs == bq) or \
                        (kind[k] == 2 and (k - P - R) // bs < bq)
                else:
                    bq = (q - P - R) // bs
                    want = kind[k] == 0 or (kind[k] == 2 and (k - P - R) // bs <= bq)
                assert bool(allowed[q, k]) == want, (i, q, k)
        assert not allowed[:n, n:].any()


def test_block_training_matches_cached_decoding(tok, pairs):
    """The decoder's view (prompt prefill, clean blocks appended to a cache, noisy block on top with an
    all-ones mask) gives the same logits as the vectorised training layout."""
    bs = 4
    torch.manual_seed(0)
    model = build_model(tok, "micro", attention="block_causal", block_size=bs).eval()
    obj = BlockObjective.from_tokenizer(tok, block_size=bs, eps=0.5)
    p, r = pairs[0]
    b = obj.make_batch([(p, r)], torch.Generator().manual_seed(1))
    with torch.no_grad():
        train_logits = model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask,
                             use_cache=False).logits[0]
        P = len(p)
        R = math.ceil(len(r) / bs) * bs
        ids = b.input_ids[0]
        for blk in range(R // bs):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([p]), position_ids=torch.arange(P)[None],
                  attention_mask=torch.zeros(1, 1, P, P), cache=cache, use_cache=True)
            for prev in range(blk):  # finished blocks: clean tokens, full attention to cache + block
                s = P + R + prev * bs
                T = cache.layers[0].keys.shape[2]
                model(input_ids=ids[s:s + bs][None], position_ids=b.position_ids[0, s:s + bs][None],
                      attention_mask=torch.zeros(1, 1, bs, T + bs), cache=cache, use_cache=True)
            s = P + blk * bs
            T = cache.layers[0].keys.shape[2]
            out = model(input_ids=ids[s:s + bs][None], position_ids=b.position_ids[0, s:s + bs][None],
                        attention_mask=torch.zeros(1, 1, bs, T + bs), cache=cache, use_cache=True)
            assert torch.allclose(out.logits[0], train_logits[s:s + bs], atol=1e-4)


# ------------------------------------------------------------------------------------------
# every objective: shapes, finite loss, loss decreases on a fixed batch
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ar", "refusion", "mdm", "block"])
def test_loss_decreases(tok, pairs, name):
    torch.manual_seed(0)
    obj = OBJECTIVES[name].from_tokenizer(tok)
    model = build_model(tok, "micro", attention=obj.attention, block_size=getattr(obj.options, "block_size", None))
    batch = obj.make_batch(pairs, torch.Generator().manual_seed(0))
    B, L = batch.input_ids.shape
    for t in (batch.position_ids, batch.labels, batch.masked, batch.weights):
        assert t.shape == (B, L)
    assert batch.attention_mask.shape in ((B, L), (B, 1, L, L))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss, metrics = obj.loss(model, batch)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    if obj.diffusion:
        assert 0.0 <= metrics["masked_acc"] <= 1.0
    if name == "refusion":
        assert {"loss_ar", "loss_mdm"} <= set(metrics)


# ------------------------------------------------------------------------------------------
# logits only at labelled positions
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ar", "refusion", "mdm", "block"])
def test_loss_reads_logits_only_at_labelled_positions(tok, pairs, name):
    """The output head runs on the positions where some row has a label, never the prompt's, and the loss,
    metrics and gradients equal those computed from the logits of every position."""
    torch.manual_seed(0)
    obj = OBJECTIVES[name].from_tokenizer(tok)
    model = build_model(tok, "micro", attention=obj.attention, block_size=getattr(obj.options, "block_size", None))
    batch = obj.make_batch(pairs, torch.Generator().manual_seed(1))
    L = batch.input_ids.shape[1]
    labelled = (batch.labels != IGNORE).any(0)
    assert torch.equal(batch.label_positions, labelled.nonzero().flatten())
    assert 0 < batch.label_positions.numel() < L  # the prompts carry no label
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: head_rows.append(i[0].shape[:2]))
    loss, metrics = obj.loss(model, batch)
    hook.remove()
    assert head_rows == [(len(pairs), batch.label_positions.numel())]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    every = obj.make_batch(pairs, torch.Generator().manual_seed(1))
    every.label_positions = torch.arange(L)  # every position through the head
    loss_all, metrics_all = obj.loss(model, every)
    loss_all.backward()
    assert loss.item() == pytest.approx(loss_all.item(), rel=1e-6)
    assert metrics.keys() == metrics_all.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(metrics_all[k], rel=1e-6, nan_ok=True)
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_label_logits_with_a_model_that_ignores_logits_to_keep(tok, pairs):
    torch.manual_seed(0)
    obj = RefusionObjective.from_tokenizer(tok)
    model = build_model(tok, "micro")

    class AllRows(torch.nn.Module):  # remote-code models without logits_to_keep
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, logits_to_keep=None, **kw):
            return self.inner(**kw)

    batch = obj.make_batch(pairs, torch.Generator().manual_seed(1))
    logits, targets = obj.label_logits(AllRows(), batch)
    want, _ = obj.label_logits(model, batch)
    assert logits.shape == want.shape == (len(pairs), batch.label_positions.numel(), model.config.vocab_size)
    assert torch.allclose(logits, want, atol=1e-6)
    assert torch.equal(targets.labels, batch.labels[:, batch.label_positions])


@pytest.mark.parametrize("name", ["ar", "refusion", "mdm"])
def test_cross_entropy_in_checkpointed_chunks_equals_one_pass(tok, pairs, name, monkeypatch):
    """Above CE_CHUNK_ELEMENTS 16-bit logits the loss runs chunk by chunk, each chunk recomputed in the
    backward pass; loss, metrics and gradients are those of one pass. Float32 logits take one pass."""
    import refusion.core.objective as objective_module

    def run(dtype=torch.bfloat16):
        torch.manual_seed(0)
        obj = OBJECTIVES[name].from_tokenizer(tok)
        model = build_model(tok, "micro", attention=obj.attention).to(dtype)
        loss, metrics = obj.loss(model, obj.make_batch(pairs, torch.Generator().manual_seed(2)))
        loss.backward()
        return loss.item(), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    whole = run()
    calls = []
    real_rows_ce = objective_module._rows_ce
    monkeypatch.setattr(objective_module, "_rows_ce", lambda x, y: calls.append(len(y)) or real_rows_ce(x, y))
    monkeypatch.setattr(objective_module, "CE_CHUNK_ELEMENTS", 5 * len(tok))  # 5 rows per chunk
    chunked = run()
    n_chunks = len(calls) // 2
    assert n_chunks > 3 and max(calls) == 5
    assert sorted(calls[:n_chunks]) == sorted(calls[n_chunks:])  # the backward pass recomputes each chunk once
    assert chunked[0] == pytest.approx(whole[0], rel=1e-6)
    assert chunked[1] == pytest.approx(whole[1], rel=1e-6, nan_ok=True)
    for n, g in whole[2].items():
        assert torch.allclose(chunked[2][n], g, rtol=1e-5, atol=1e-7), n
    calls.clear()
    run(torch.float32)
    assert len(calls) == 1  # float32 logits with gradients: one pass over every row, nothing recomputed
    calls.clear()
    with torch.no_grad():
        obj = OBJECTIVES[name].from_tokenizer(tok)
        model = build_model(tok, "micro", attention=obj.attention)
        loss, _ = obj.loss(model, obj.make_batch(pairs, torch.Generator().manual_seed(2)))
    assert len(calls) == n_chunks and max(calls) == 5  # without gradients: chunks, none recomputed
    monkeypatch.setattr(objective_module, "CE_CHUNK_ELEMENTS", 1 << 26)
    with torch.no_grad():
        assert obj.loss(model, obj.make_batch(pairs, torch.Generator().manual_seed(2)))[0].item() == \
            pytest.approx(loss.item(), rel=1e-6)
