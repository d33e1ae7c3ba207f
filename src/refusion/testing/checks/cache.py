"""The check of a cache manager (ReFusion's merge of the chosen slots' KV into one row), on a tiny random
model."""

from __future__ import annotations

import torch

from refusion.testing._hypothesis import st
import refusion.testing.strategies as S
import refusion.testing.checks.base as base
from refusion.testing.checks.base import CheckReport, _contract, _options, _resolve, backbone


# -- cache manager ----------------------------------------------------------------------------------------------

CACHE_SHAPE = _contract("cache", "merge_rows gives one row holding the prefix and every slot's tokens")
CACHE_FIRST = _contract("cache", "the prefix and the first slot are exact: after them the model predicts what a "
                                 "fresh forward of prefix + first slot predicts")
CACHE_EXACT = _contract("cache", "position invariance: a manager declaring exact = True equals a fresh forward of "
                                 "the prefix and the slots in buffer order with their original position ids, "
                                 "whatever order the slots' positions are in")


@st.composite
def _merge_case(draw):
    n = draw(st.integers(1, 4))
    P = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    width = max(sizes) + draw(st.integers(0, 1))  # rows may hold more than the kept tokens
    order = draw(S.reorderings(n))  # slot order in the buffer vs their positions
    starts, at = {}, P
    for s in range(n):
        starts[s] = at
        at += width
    tokens = [draw(st.lists(st.integers(*S.PROMPT_TOKENS), min_size=width, max_size=width)) for _ in range(n)]
    prefix = draw(st.lists(st.integers(*S.PROMPT_TOKENS), min_size=P, max_size=P))
    rows = [(tokens[s], list(range(starts[s], starts[s] + width)), sizes[s]) for s in order]
    probe = draw(st.lists(st.integers(*S.PROMPT_TOKENS), min_size=1, max_size=3))
    return prefix, rows, probe, at


def check_cache_manager(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                        raise_on_failure: bool = True, exact: bool | None = None) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.CacheManager` on a tiny causal model. ``exact`` (default: the
    class's ``exact`` attribute) asks for every slot to equal a fresh forward, not only the first."""
    from refusion.core.loop import ForwardRequest

    cls, name = _resolve("cache", cls_or_name, registry)
    opts = _options(cls, options)
    exact = getattr(cls, "exact", False) if exact is None else exact

    def run(o, case):
        bb = backbone()
        prefix, rows, probe, end = case
        P = len(prefix)
        base = bb.new_cache()
        base.forward(ForwardRequest(base, torch.tensor(prefix), torch.arange(P), logits_at=None))
        fork = base.fork(len(rows))
        fork.forward(ForwardRequest(fork, torch.tensor([t for t, _, _ in rows]), torch.tensor([p for _, p, _ in rows]),
                                    logits_at=None))
        kept = [t[:m] for t, _, m in rows]
        kept_pos = [p[:m] for _, p, m in rows]
        merged = cls(o).merge_rows(bb, fork, P, kept, kept_pos)
        return bb, base, merged, prefix, kept, kept_pos, probe, end

    def probe_logits(cache, probe, end):
        ids = torch.tensor(probe)
        return cache.forward(ForwardRequest(cache, ids, torch.arange(end, end + len(probe)), keep_kv=False))[0]

    def fresh(bb, prefix, kept, kept_pos):
        c = bb.new_cache()
        ids = prefix + [t for r in kept for t in r]
        pos = list(range(len(prefix))) + [p for r in kept_pos for p in r]
        c.forward(ForwardRequest(c, torch.tensor(ids), torch.tensor(pos), logits_at=None))
        return c

    def shape(o, case):
        bb, base, merged, prefix, kept, kept_pos, probe, end = run(o, case)
        want = len(prefix) + sum(map(len, kept))
        assert merged.n_rows() == 1 and merged.length() == want, \
            f"slots of {[len(r) for r in kept]} tokens after a prefix of {len(prefix)}: merged cache has {merged.n_rows()} rows of {merged.length()}, expected 1 of {want}"

    def first(o, case):
        bb, base, merged, prefix, kept, kept_pos, probe, end = run(o, case)
        merged.crop(len(prefix) + len(kept[0]))
        a = probe_logits(merged, probe, end)
        b = probe_logits(fresh(bb, prefix, kept[:1], kept_pos[:1]), probe, end)
        assert torch.allclose(a, b, atol=1e-4), f"after prefix + first slot {kept[0]} at {kept_pos[0]}: logits differ from a fresh forward by {float((a - b).abs().max()):.3g}"

    def exact_(o, case):
        bb, base, merged, prefix, kept, kept_pos, probe, end = run(o, case)
        a = probe_logits(merged, probe, end)
        b = probe_logits(fresh(bb, prefix, kept, kept_pos), probe, end)
        assert torch.allclose(a, b, atol=1e-4), (f"slots {kept} at positions {kept_pos} (buffer order): logits after the "
                                                 f"merged cache differ from a fresh forward by {float((a - b).abs().max()):.3g}")

    props = [(CACHE_SHAPE, shape, dict(o=opts, case=_merge_case())),
             (CACHE_FIRST, first, dict(o=opts, case=_merge_case()))]
    if exact:
        props.append((CACHE_EXACT, exact_, dict(o=opts, case=_merge_case())))
    return base._run(CheckReport("cache", name), props, max_examples, raise_on_failure)
