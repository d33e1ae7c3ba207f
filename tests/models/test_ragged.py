"""RaggedCache: rows of different lengths in one cache; each row decodes as its own single-row cache."""

import torch

from refusion.models.ragged import ForwardRequest, RaggedCache

TOL = dict(atol=1e-5, rtol=1e-4)


def single(backbone, ids, pos=None, cache=None, **kw):
    ids = torch.tensor(ids)
    pos = torch.arange(len(ids)) if pos is None else torch.tensor(pos)
    return backbone.forward(ids, pos, cache, **kw)


def test_rows_of_different_lengths_match_their_own_caches(backbone):
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30]]
    shared = RaggedCache(backbone)
    views = [shared.new_view() for _ in prompts]
    requests = [ForwardRequest(v, torch.tensor(p), torch.arange(len(p))) for v, p in zip(views, prompts)]
    logits = shared.forward(requests, pad_id=backbone.eos_id)
    assert shared.lengths == [3, 7, 1]
    caches = [backbone.new_cache() for _ in prompts]
    for p, c, got in zip(prompts, caches, logits):
        torch.testing.assert_close(got, single(backbone, p, cache=c), **TOL)
    # a second step: different token counts per row, one row keeps no KV, one reads only its last logits
    steps = [[13, 14], [27], [31, 32, 33]]
    requests = [ForwardRequest(views[0], torch.tensor(steps[0]), torch.tensor([3, 4])),
                ForwardRequest(views[1], torch.tensor(steps[1]), torch.tensor([7]), keep_kv=False),
                ForwardRequest(views[2], torch.tensor(steps[2]), torch.tensor([1, 2, 3]), logits_at=slice(-1, None))]
    logits = shared.forward(requests, pad_id=backbone.eos_id)
    assert shared.lengths == [5, 7, 4]
    want = [single(backbone, steps[0], [3, 4], caches[0]),
            single(backbone, steps[1], [7], caches[1], keep_kv=False),
            single(backbone, steps[2], [1, 2, 3], caches[2], logits_at=slice(-1, None))]
    for got, w in zip(logits, want):
        assert got.shape == w.shape
        torch.testing.assert_close(got, w, **TOL)


def test_fork_crop_merge_and_release(backbone):
    shared = RaggedCache(backbone)
    a, b = shared.new_view(), shared.new_view()
    shared.forward([ForwardRequest(a, torch.tensor([10, 11, 12]), torch.arange(3)),
                    ForwardRequest(b, torch.tensor([20, 21]), torch.arange(2))], pad_id=backbone.eos_id)
    ref = backbone.new_cache()
    single(backbone, [10, 11, 12], cache=ref)
    backbone.repeat_rows(a, 2)  # two rows for a, b keeps its row
    backbone.repeat_rows(ref, 2)
    assert backbone.cache_rows(a) == 2 and backbone.cache_rows(b) == 1 and len(shared.lengths) == 3
    rows = torch.tensor([[13, 14], [15, 16]])
    pos = torch.tensor([[3, 4], [5, 6]])
    got = shared.forward([ForwardRequest(a, rows, pos)], pad_id=backbone.eos_id)[0]  # a alone: a subset of rows
    torch.testing.assert_close(got, backbone.forward(rows, pos, ref), **TOL)
    backbone.crop(a, 4)
    backbone.crop(ref, 4)
    backbone.concat_rows(a, 3, [1, 1])  # prefix + row 0's first token + row 1's first token
    backbone.concat_rows(ref, 3, [1, 1])
    assert backbone.cache_rows(a) == 1 and backbone.cache_len(a) == 5
    after = [single(backbone, [17], [7], c) for c in (a, ref)]
    torch.testing.assert_close(after[0], after[1], **TOL)
    a.release()
    assert len(shared.lengths) == 1 and b.rows == [0] and shared.lengths == [2]
    got = shared.forward([ForwardRequest(b, torch.tensor([22]), torch.tensor([2]))], pad_id=backbone.eos_id)[0]
    ref_b = backbone.new_cache()
    single(backbone, [20, 21], cache=ref_b)
    torch.testing.assert_close(got, single(backbone, [22], [2], ref_b), **TOL)


def test_logits_only_at_the_union_of_requested_positions(backbone):
    shared = RaggedCache(backbone)
    a, b = shared.new_view(), shared.new_view()
    rows0 = backbone.logits_rows
    out = shared.forward([ForwardRequest(a, torch.tensor([10, 11, 12, 13]), torch.arange(4), logits_at=[1]),
                          ForwardRequest(b, torch.tensor([20, 21]), torch.arange(2), logits_at=None)],
                         pad_id=backbone.eos_id)
    assert out[0].shape[:2] == (1, 1) and out[1] is None
    assert backbone.logits_rows - rows0 == 2  # one position, both rows of the batch


def test_forking_and_dropping_rows_copy_nothing_until_the_next_forward(backbone):
    shared = RaggedCache(backbone)
    a, b, c = shared.new_view(), shared.new_view(), shared.new_view()
    shared.forward([ForwardRequest(v, torch.tensor([10 + i, 11]), torch.arange(2)) for i, v in enumerate((a, b, c))],
                   pad_id=backbone.eos_id)
    buffer = shared.keys[0]
    backbone.repeat_rows(b, 3)
    a.release()
    assert shared.keys[0] is buffer and shared.phys == [1, 1, 1, 2] and shared.lengths == [2, 2, 2, 2]
    ref = backbone.new_cache()
    single(backbone, [11, 11], cache=ref)
    backbone.repeat_rows(ref, 3)
    rows = torch.tensor([[12], [13], [14]])
    got = shared.forward([ForwardRequest(b, rows, torch.tensor([[2], [2], [2]])),
                          ForwardRequest(c, torch.tensor([15]), torch.tensor([2]))], pad_id=backbone.eos_id)
    assert shared.keys[0].shape[0] == 4 and shared.phys == [0, 1, 2, 3]  # one gather, in request order
    torch.testing.assert_close(got[0], backbone.forward(rows, torch.tensor([[2], [2], [2]]), ref), **TOL)
