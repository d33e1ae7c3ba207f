"""Built-in cache managers for slots completed in parallel rows (ReFusion Stage II-b).

* ``kv_concat`` (the paper's KV reuse): each completed slot's KV, computed with context = committed
  prefix + that slot only, is appended slot after slot. Approximate when several slots complete
  together: slot j's KV never saw slot i < j of the same round. Costs no forward.
* ``kv_recompute`` (paper Table 8 ablation): the completed slots are fed once more, concatenated, on top
  of the committed cache, so their KV has full context. Costs one forward when two or more slots
  complete together; with one slot the row's KV already has full context and is kept as is.
"""

from __future__ import annotations

import torch

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import CacheManager
from refusion.core.loop import ForwardRequest


class KVConcat(CacheManager):
    def merge_rows(self, backbone, rows, base_len, tokens, positions):
        rows.concat_rows(base_len, [len(t) for t in tokens])
        return rows


class KVRecompute(CacheManager):
    exact = True  # the completed slots are fed once more with full context

    def merge_rows(self, backbone, rows, base_len, tokens, positions):
        if rows.n_rows() == 1:
            rows.crop(base_len + len(tokens[0]))
            return rows
        rows.select([0])
        rows.crop(base_len)
        ids = torch.tensor([t for row in tokens for t in row])
        pos = torch.tensor([p for row in positions for p in row])
        if ids.numel():
            rows.forward(ForwardRequest(rows, ids, pos, logits_at=None))
        return rows


@hookimpl
def register_caches(register):
    register("kv_concat", KVConcat)
    register("kv_recompute", KVRecompute)
