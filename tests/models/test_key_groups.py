"""Attention in key groups (models/ragged_forward.py, opt-in: ``Backbone.use_key_groups``, ``$REFUSION_KEY_GROUPS``): rows
of a batched forward whose keys end early, one after another, attend over fewer keys in a group of their own.
The split is the cheapest contiguous one, and a forward in groups gives each row the logits of the same forward
in one group."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.loop import CAUSAL, FULL, Attention, ForwardRequest
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache
from refusion.models.ragged_forward import GROUP_KEYS_CPU, GROUPED_SDPA, PAIR_PER_KEY, key_groups
from refusion.testing.models import make_tiny_qwen3


def cost(groups, fed, price):
    return sum(price + (b - a) * w * (1 + fed * PAIR_PER_KEY) for a, b, w in groups) - price


@given(needs=st.lists(st.integers(1, 60), min_size=1, max_size=9), fed=st.integers(2, 5),
       price=st.floats(0, 120))
def test_key_groups_is_the_cheapest_contiguous_split(needs, fed, price):
    """Against every split of the rows into consecutive groups: no cheaper one, each group's width its
    longest row's need, the groups cover the rows in order; None exactly where one group is cheapest."""
    n = len(needs)
    splits = []
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, n), k) for k in range(n)):
        bounds = [0, *cuts, n]
        splits.append([(a, b, max(needs[a:b])) for a, b in zip(bounds, bounds[1:])])
    best = min(cost(s, fed, price) for s in splits)
    got = key_groups(needs, fed, price)
    one = [(0, n, max(needs))]
    if got is None:
        assert cost(one, fed, price) <= best + 1e-6
        return
    assert got[0][0] == 0 and got[-1][1] == n and all(x[1] == y[0] for x, y in zip(got, got[1:]))
    assert all(w == max(needs[a:b]) for a, b, w in got)
    assert len(got) > 1 and cost(got, fed, price) <= best + 1e-6 < cost(one, fed, price)


def test_over_64_rows_groups_start_on_a_coarser_grid():
    needs = list(range(300, 100, -1))  # 200 rows, each shorter than the last
    groups = key_groups(needs, 2, 50.0)
    assert groups is not None and all(a % 4 == 0 for a, _, _ in groups)  # ceil(200 / 64) = 4
    assert sum((b - a) * w for a, b, w in groups) < len(needs) * max(needs)


def test_a_free_group_per_row_a_prohibitive_price_and_one_token_rows():
    needs = [40, 30, 30, 10]
    assert key_groups(needs, 2, 0.5) == [(0, 1, 40), (1, 3, 30), (3, 4, 10)]  # equal needs share a group
    assert key_groups(needs, 2, 1e9) is None
    assert key_groups(needs, 1, 0.0) is None  # one token a row: no groups


@pytest.mark.parametrize("kind", ["causal", "full", "block"])
def test_rows_in_key_groups_get_the_logits_of_one_group(backbone, kind):
    """Rows of very different lengths, every attention kind, steps of different widths (one keeping no KV):
    the forwards in groups (a group costing next to nothing: one group per distinct length) give each row the
    logits of the same forwards in one group, and attend fewer (row, key) pairs."""
    def attention(n, first):
        return {"causal": CAUSAL, "full": FULL}.get(kind) or Attention.block_causal([first + t // 2 for t in range(n)])

    prompts = [[4 + (7 * k + n) % 20 for k in range(n)] for n in (40, 3, 25, 1, 12)]
    steps = [[5, 6], [7], [8, 9, 10], [11], [12, 13]]
    got = {}
    for price in (None, 0.5):
        assert backbone.use_key_groups(price) == (price is not None)
        shared = RaggedCache(backbone)
        views = [shared.new_view() for _ in prompts]
        out = []
        for phase, feeds in enumerate((prompts, steps)):
            requests = []
            for i, (view, ids) in enumerate(zip(views, feeds)):
                start = view.length()
                requests.append(ForwardRequest(view, torch.tensor(ids), torch.arange(start, start + len(ids)),
                                               attention=attention(len(ids), phase),
                                               keep_kv=not (phase == 1 and i == 1)))
            out.append(shared.forward(requests))
        got[price] = (out, shared.pairs_attended)
    backbone.use_key_groups(None)
    (one, one_pairs), (grouped, grouped_pairs) = got[None], got[0.5]
    for a, b in zip(one, grouped):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-4)
            assert torch.equal(y.argmax(-1), x.argmax(-1))
    # the prompts: 5 rows over 40 keys; the steps (3 wide): rows of 40, 3, 25, 1 and 12 keys padded to 43 in
    # one group, each over its own in groups
    assert (one_pairs, grouped_pairs) == (5 * 40 + 5 * 43, 5 * 40 + 43 + 6 + 28 + 4 + 15)


def test_key_groups_are_opt_in_and_only_for_an_uncompiled_sdpa_model(char_tokenizer):
    plain = make_tiny_qwen3(len(char_tokenizer))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = plain(ids).logits
    sdpa = Backbone(plain, char_tokenizer)
    assert sdpa.group_keys is None and sdpa.model.config._attn_implementation == "sdpa"  # off by default
    assert sdpa.use_key_groups() and sdpa.group_keys == GROUP_KEYS_CPU
    assert sdpa.model.config._attn_implementation == GROUPED_SDPA
    with torch.no_grad():  # outside a grouped forward the implementation is sdpa's
        torch.testing.assert_close(sdpa.model(ids).logits, before, atol=0, rtol=0)
    with pytest.raises(ValueError, match="price of a group must be 0 or more"):
        sdpa.use_key_groups(-1.0)
    assert sdpa.group_keys == GROUP_KEYS_CPU  # a refused price changes nothing
    assert not sdpa.use_key_groups(None) and sdpa.group_keys is None
    assert sdpa.use_key_groups(7.0) and sdpa.group_keys == 7.0
    eager_model = make_tiny_qwen3(len(char_tokenizer))
    eager_model.set_attn_implementation("eager")
    eager = Backbone(eager_model, char_tokenizer)
    assert not eager.use_key_groups() and eager.group_keys is None
    assert eager.model.config._attn_implementation == "eager"
    compiled = Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer, compile="default")
    assert not compiled.use_key_groups() and compiled.group_keys is None
    assert compiled.model.config._attn_implementation == "sdpa"


def test_the_environment_sets_key_groups_at_load_and_a_bad_value_is_refused(char_tokenizer, monkeypatch):
    monkeypatch.setenv("REFUSION_KEY_GROUPS", "off")
    assert Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer).group_keys is None
    monkeypatch.setenv("REFUSION_KEY_GROUPS", "250")
    assert Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer).group_keys == 250.0
    monkeypatch.setenv("REFUSION_KEY_GROUPS", "auto")
    assert Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer).group_keys == GROUP_KEYS_CPU
    monkeypatch.delenv("REFUSION_KEY_GROUPS")
    assert Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer).group_keys is None
    for bad in ("-1", "cheap", "nan"):
        monkeypatch.setenv("REFUSION_KEY_GROUPS", bad)
        with pytest.raises(ValueError, match=r"\$REFUSION_KEY_GROUPS: expected auto, off or"):
            Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer)
