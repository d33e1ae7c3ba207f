"""KV caches: a RaggedCache's rows of different lengths each decode as their own single-sequence
DenseCache, whatever the attention of the request; the cache operations agree between the two."""

import pytest
import torch

from refusion.core.loop import CAUSAL, FULL, Attention, ForwardRequest
from refusion.models.kvcache import RaggedCache

TOL = dict(atol=1e-5, rtol=1e-4)


def single(backbone, ids, pos=None, cache=None, **kw):
    ids = torch.tensor(ids)
    pos = torch.arange(len(ids)) if pos is None else torch.tensor(pos)
    cache = backbone.new_cache() if cache is None else cache
    return cache.forward(ForwardRequest(cache, ids, pos, **kw))


def test_rows_of_different_lengths_match_their_own_caches(backbone):
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30]]
    shared = RaggedCache(backbone)
    views = [shared.new_view() for _ in prompts]
    requests = [ForwardRequest(v, torch.tensor(p), torch.arange(len(p))) for v, p in zip(views, prompts)]
    logits = shared.forward(requests)
    assert shared.lengths == [3, 7, 1]
    caches = [backbone.new_cache() for _ in prompts]
    for p, c, got in zip(prompts, caches, logits):
        torch.testing.assert_close(got, single(backbone, p, cache=c), **TOL)
    # a second step: different token counts per row, one row keeps no KV, one reads only its last logits
    steps = [[13, 14], [27], [31, 32, 33]]
    requests = [ForwardRequest(views[0], torch.tensor(steps[0]), torch.tensor([3, 4])),
                ForwardRequest(views[1], torch.tensor(steps[1]), torch.tensor([7]), keep_kv=False),
                ForwardRequest(views[2], torch.tensor(steps[2]), torch.tensor([1, 2, 3]), logits_at=slice(-1, None))]
    logits = shared.forward(requests)
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
                    ForwardRequest(b, torch.tensor([20, 21]), torch.arange(2))])
    ref = backbone.new_cache()
    single(backbone, [10, 11, 12], cache=ref)
    a.repeat_rows(2)  # two rows for a, b keeps its row
    ref.repeat_rows(2)
    assert a.n_rows() == 2 and b.n_rows() == 1 and len(shared.lengths) == 3
    rows = torch.tensor([[13, 14], [15, 16]])
    pos = torch.tensor([[3, 4], [5, 6]])
    got = shared.forward([ForwardRequest(a, rows, pos)])[0]  # a alone: a subset of rows
    torch.testing.assert_close(got, ref.forward(ForwardRequest(ref, rows, pos)), **TOL)
    a.crop(4)
    ref.crop(4)
    a.concat_rows(3, [1, 1])  # prefix + row 0's first token + row 1's first token
    ref.concat_rows(3, [1, 1])
    assert a.n_rows() == 1 and a.length() == 5
    after = [single(backbone, [17], [7], c) for c in (a, ref)]
    torch.testing.assert_close(after[0], after[1], **TOL)
    shared.release(a)
    assert len(shared.lengths) == 1 and b.rows == [0] and shared.lengths == [2]
    got = shared.forward([ForwardRequest(b, torch.tensor([22]), torch.tensor([2]))])[0]
    ref_b = backbone.new_cache()
    single(backbone, [20, 21], cache=ref_b)
    torch.testing.assert_close(got, single(backbone, [22], [2], ref_b), **TOL)


def test_logits_only_at_the_union_of_requested_positions(backbone):
    shared = RaggedCache(backbone)
    a, b = shared.new_view(), shared.new_view()
    rows0 = backbone.logits_rows
    out = shared.forward([ForwardRequest(a, torch.tensor([10, 11, 12, 13]), torch.arange(4), logits_at=[1]),
                          ForwardRequest(b, torch.tensor([20, 21]), torch.arange(2), logits_at=None)])
    assert out[0].shape[:2] == (1, 1) and out[1] is None
    assert backbone.logits_rows - rows0 == 1  # one position of the one row that reads it


def test_forking_and_dropping_rows_copy_nothing_until_the_next_forward(backbone):
    shared = RaggedCache(backbone)
    a, b, c = shared.new_view(), shared.new_view(), shared.new_view()
    shared.forward([ForwardRequest(v, torch.tensor([10 + i, 11]), torch.arange(2)) for i, v in enumerate((a, b, c))])
    buffer = shared.keys[0]
    b.repeat_rows(3)
    shared.release(a)
    assert shared.keys[0] is buffer and shared.phys == [1, 1, 1, 2] and shared.lengths == [2, 2, 2, 2]
    ref = backbone.new_cache()
    single(backbone, [11, 11], cache=ref)
    ref.repeat_rows(3)
    rows = torch.tensor([[12], [13], [14]])
    got = shared.forward([ForwardRequest(b, rows, torch.tensor([[2], [2], [2]])),
                          ForwardRequest(c, torch.tensor([15]), torch.tensor([2]))])
    assert shared.keys[0].shape[0] == 4 and shared.phys == [0, 1, 2, 3]  # one gather, in request order
    torch.testing.assert_close(got[0], ref.forward(ForwardRequest(ref, rows, torch.tensor([[2], [2], [2]]))), **TOL)


@pytest.mark.parametrize("kind", ["causal", "full", "block"])
def test_each_attention_kind_in_a_ragged_batch_matches_its_own_cache(backbone, kind):
    """Requests of one model call attend as each says: a prefill, then steps of different widths, one
    of them keeping no KV; each row's logits equal those of its own DenseCache."""
    def attention(n, first):
        if kind == "causal":
            return CAUSAL
        if kind == "full":
            return FULL
        return Attention.block_causal([first + t // 2 for t in range(n)])

    prompts = [[10, 11, 12], [20, 21, 22, 23, 24], [30]]
    steps = [[13, 14, 15, 16], [25], [31, 32]]
    shared = RaggedCache(backbone)
    views = [shared.new_view() for _ in prompts]
    dense = [backbone.new_cache() for _ in prompts]
    for phase, feeds in enumerate((prompts, steps)):
        requests, want = [], []
        for i, (view, cache, ids) in enumerate(zip(views, dense, feeds)):
            start = cache.length()
            kw = dict(attention=attention(len(ids), phase), keep_kv=not (phase == 1 and i == 1))
            args = (torch.tensor(ids), torch.arange(start, start + len(ids)))
            requests.append(ForwardRequest(view, *args, **kw))
            want.append(cache.forward(ForwardRequest(cache, *args, **kw)))
        got = shared.forward(requests)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)
    assert [v.length() for v in views] == [c.length() for c in dense] == [7, 5, 3]


def test_drop_span_and_release_empty_the_batch(backbone):
    shared = RaggedCache(backbone)
    a, b = shared.new_view(), shared.new_view()
    ref = backbone.new_cache()
    shared.forward([ForwardRequest(a, torch.tensor([10, 11, 12, 13, 14]), torch.arange(5), attention=FULL),
                    ForwardRequest(b, torch.tensor([20, 21]), torch.arange(2), attention=FULL)])
    single(backbone, [10, 11, 12, 13, 14], cache=ref, attention=FULL)
    a.drop_span(1, 3)
    ref.drop_span(1, 3)
    assert a.length() == ref.length() == 3 and b.length() == 2
    request = dict(attention=FULL, keep_kv=False)
    got = a.forward(ForwardRequest(a, torch.tensor([15, 16]), torch.tensor([1, 2]), **request))
    torch.testing.assert_close(got, single(backbone, [15, 16], [1, 2], cache=ref, **request), **TOL)
    shared.release(a)
    shared.release(b)
    assert shared.lengths == [] and shared.keys == [] and shared.views == []


def test_head_runs_on_each_rows_own_positions(backbone):
    """Rows asking for different positions: the head computes each row's own (not the union in every
    row), and every request's logits are those of its own cache."""
    prompts = [[10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34]]
    asked = [[0, 3], [1], slice(-2, None)]
    shared = RaggedCache(backbone)
    views = [shared.new_view() for _ in prompts]
    rows0 = backbone.logits_rows
    got = shared.forward([ForwardRequest(v, torch.tensor(p), torch.arange(len(p)), logits_at=a)
                          for v, p, a in zip(views, prompts, asked)])
    assert backbone.logits_rows - rows0 == 2 + 1 + 2  # the union {0, 1, 3, 4} in 3 rows would be 12
    for p, a, g in zip(prompts, asked, got):
        want = single(backbone, p, logits_at=a)
        assert g.shape == want.shape
        torch.testing.assert_close(g, want, **TOL)
    # several rows of one sequence, one request reading nothing, one reading no position at all
    views[0].repeat_rows(2)
    steps = [ForwardRequest(views[0], torch.tensor([[14, 15], [16, 17]]), torch.tensor([[4, 5], [4, 5]]),
                            logits_at=[1], keep_kv=False),
             ForwardRequest(views[1], torch.tensor([23]), torch.tensor([3]), logits_at=None),
             ForwardRequest(views[2], torch.tensor([35, 36]), torch.tensor([5, 6]), logits_at=[])]
    rows0 = backbone.logits_rows
    got = shared.forward(steps)
    assert backbone.logits_rows - rows0 == 2 and got[1] is None and got[2].shape == (1, 0, got[0].shape[-1])
    ref = backbone.new_cache()
    single(backbone, prompts[0], cache=ref)
    ref.repeat_rows(2)
    torch.testing.assert_close(got[0], ref.forward(ForwardRequest(ref, steps[0].ids, steps[0].pos, logits_at=[1],
                                                                  keep_kv=False)), **TOL)


def test_live_sequences_counts_the_unfinished_sequences_of_the_batch(backbone):
    shared = RaggedCache(backbone)
    a, b, c = shared.new_view(), shared.new_view(), shared.new_view()
    assert [v.live_sequences() for v in (a, b, c)] == [3, 3, 3] and backbone.new_cache().live_sequences() == 1
    b.repeat_rows(4)  # rows are not sequences
    shared.release(a)
    assert b.live_sequences() == c.live_sequences() == 2


def test_a_sequence_joining_a_running_batch_takes_a_spare_row_without_copying_the_buffers(backbone):
    """Continuous batching: a finished sequence's row is freed by the next forward's gather, which keeps the
    buffers' row count; a sequence admitted after it takes that row (zeroed) and the buffers stay the same
    tensors. Its decode is its own cache's."""
    shared = RaggedCache(backbone)
    views = [shared.new_view() for _ in range(3)]
    shared.forward([ForwardRequest(v, torch.tensor([10 + i, 11, 12]), torch.arange(3)) for i, v in enumerate(views)])
    shared.release(views[0])
    shared.forward([ForwardRequest(v, torch.tensor([13]), torch.tensor([3])) for v in views[1:]])  # a gather
    assert shared.keys[0].shape[0] == 3 and shared.phys == [0, 1]  # a spare row kept
    buffers = [t.data_ptr() for t in (*shared.keys, *shared.values)]
    joined = shared.new_view()
    assert [t.data_ptr() for t in (*shared.keys, *shared.values)] == buffers  # no copy
    assert all(t[shared.phys[-1]].abs().sum() == 0 for t in (*shared.keys, *shared.values))  # zeroed
    got = shared.forward([ForwardRequest(joined, torch.tensor([40, 41]), torch.arange(2))])[0]
    torch.testing.assert_close(got, single(backbone, [40, 41]), **TOL)
    step = [ForwardRequest(v, torch.tensor([14]), torch.tensor([4])) for v in views[1:]]
    step.append(ForwardRequest(joined, torch.tensor([42]), torch.tensor([2])))
    got = shared.forward(step)
    assert [t.data_ptr() for t in (*shared.keys, *shared.values)] == buffers  # in order: written in place
    ref = backbone.new_cache()
    single(backbone, [40, 41], cache=ref)
    torch.testing.assert_close(got[2], single(backbone, [42], [2], ref), **TOL)
    held = []
    for _ in range(3):  # no spare row left: the buffers grow by half their rows (at least one)
        shared.new_view()
        held.append(shared.keys[0].shape[0])
    assert held == [4, 6, 6]


def test_a_forward_of_some_rows_copies_only_their_attended_columns(backbone):
    """A server's forward of some sequences alone (a new prompt beside the running batch, rows split by
    width) writes their new KV in place and reads only their rows' first ``width`` columns out of the
    buffers (nothing, when their buffer rows are consecutive), not their whole capacity out and back; its
    logits are each row's own cache's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shared = RaggedCache(backbone)
    a, long, b, c = (shared.new_view() for _ in range(4))
    prompts = {a: [10, 11, 12], long: [int(t) for t in torch.arange(100) % 20 + 3], b: [20, 21], c: [22]}
    shared.forward([ForwardRequest(v, torch.tensor(p), torch.arange(len(p))) for v, p in prompts.items()])
    capacity = shared.keys[0].shape[2]
    assert capacity >= 100
    refs = {v: backbone.new_cache() for v in prompts}
    for v, p in prompts.items():
        single(backbone, p, cache=refs[v])
    storages = {t.untyped_storage().data_ptr() for t in (*shared.keys, *shared.values)}
    per_column = 2 * shared.n_layers * shared.n_kv_heads * shared.head_dim  # keys and values of every layer

    class Copies(TorchDispatchMode):  # elements copied out of or into the KV buffers
        def __init__(self):
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__
            if ("index_select" in name or "index_copy" in name or name.startswith("copy")) and any(
                    isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in storages for x in args):
                self.elements += out.numel()
            return out

    def step(views, fed):
        with Copies() as copies:
            got = shared.forward([ForwardRequest(v, torch.tensor([fed]), torch.tensor([shared.lengths[v.rows[0]]]))
                                  for v in views])
        for v, logits in zip(views, got):
            torch.testing.assert_close(logits, single(backbone, [fed], [refs[v].length()], refs[v]), **TOL)
        return copies.elements

    width = 3 + 1  # a's 3 tokens and the one fed
    assert 0 < step([a, b], 30) <= 2 * width * per_column < 2 * capacity * per_column  # buffer rows 0 and 2
    assert step([b, c], 31) == 0  # buffer rows 2 and 3: a slice of the buffers
    assert shared.lengths == [4, 100, 4, 2]
    step([a, long, b, c], 32)  # every row: the KV written in place stays
