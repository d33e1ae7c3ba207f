"""The decoder check: every registered decoder's invariants over configs drawn from the registry's
parts and options, on a tiny random model of its attention kind."""

from __future__ import annotations

from refusion.testing._hypothesis import st
import refusion.testing.strategies as S
import refusion.testing.checks.base as base
from refusion.testing.checks.base import CheckReport, _contract, backbone


# -- decoder ----------------------------------------------------------------------------------------------------

DECODER_INVARIANTS = _contract(
    "decoder", "every config drawn from the registry's parts and options, any prompt, EOS forced anywhere or "
               "nowhere: no [MASK] in the output, at most gen_length tokens, nothing after the first EOS (and a "
               "forced EOS ends the output), every output position committed once and the buffer restored by "
               "position is the output (positions past it only before an EOS or past gen_length), nothing "
               "committed outside the generation span (gen_length, padded to whole slots where the decoder pads) "
               "nor, once an EOS is committed, after it, NFE equals the model's forward calls, the same seed "
               "decodes the same, the streamed commits are the output left to right, and each sequence of a "
               "batch decodes as alone")


def _stream(dec, prompt):
    steps, commits = dec.stream(prompt), []
    while True:
        try:
            commits.append(next(steps))
        except StopIteration as stop:
            return commits, stop.value


def decoder_invariants(bb, cfg: dict, prompt: list[int], other: list[int], eos_at: int | None, registry=None) -> None:
    """Assert the decoder invariants (:data:`CONTRACTS` ``["decoder"]``) for one config and prompt pair."""
    from refusion.core.config import build_decoder
    from refusion.testing.models import ban_token, force_token

    hooks = [ban_token(bb.model, bb.eos_id)]
    if eos_at is not None:
        hooks.append(force_token(bb.model, len(prompt) + eos_at, bb.eos_id, boost=2e4, mask_id=bb.mask_id))
    calls = []
    hooks.append(bb.model.register_forward_pre_hook(lambda m, a: calls.append(1)))
    try:
        try:
            dec = build_decoder(bb, cfg, registry)
        except ValueError:  # a combination the decoder refuses when built (e.g. block's pipeline + a slot selector)
            from hypothesis import assume

            assume(False)
        commits, res = _stream(dec, prompt)
        again = dec.generate(prompt)
        n_calls = len(calls)
        alone_other = dec.generate(other)
        batch = dec.generate_batch([prompt, other])
    finally:
        for h in hooks:
            h.remove()
    ids = res.token_ids
    ctx = f"config {cfg}, prompt {prompt}, EOS forced at {eos_at}: output {ids}"
    assert bb.mask_id not in ids, f"{ctx}: [MASK] ({bb.mask_id}) in the output"
    assert len(ids) <= cfg["gen_length"], f"{ctx}: {len(ids)} tokens > gen_length {cfg['gen_length']}"
    assert all(t not in bb.eos_ids for t in ids[:-1]), f"{ctx}: tokens after the first EOS"
    if eos_at is not None and eos_at < cfg["gen_length"]:
        assert len(ids) == eos_at + 1 and ids[-1] == bb.eos_id, f"{ctx}: the forced EOS does not end the output"
    if res.buffer_pos:
        P = len(prompt)
        gen = sorted(res.buffer_pos[P:])
        assert len(set(gen)) == len(gen), f"{ctx}: a position committed twice: {gen}"
        beyond = [p for p in gen if p >= P + len(ids)]
        ended = bool(ids) and (ids[-1] in bb.eos_ids or len(ids) == cfg["gen_length"])
        assert set(range(P, P + len(ids))) <= set(gen) and (not beyond or ended), \
            (f"{ctx}: committed positions {gen} are not the output's prefix range (positions past it only when "
             "the output ends with EOS or at gen_length: slots committed before the EOS, or slot padding)")
        restored = [t for _, t in sorted(zip(res.buffer_pos, res.buffer_ids))][P:]
        assert restored[: len(ids)] == ids, f"{ctx}: the buffer restored by position is {restored}"
        span = getattr(dec.options, "padded_length", cfg["gen_length"])  # refusion pads to whole slots
        assert all(p < P + span for p in gen), f"{ctx}: committed positions {gen} past the generation span {span}"
        eos_pos = None  # the leftmost EOS committed so far, in commit (buffer) order
        for p, t in zip(res.buffer_pos[P:], res.buffer_ids[P:]):
            assert eos_pos is None or p < eos_pos, \
                f"{ctx}: position {p} committed after an EOS was committed at {eos_pos} (decoding past the EOS)"
            if t in bb.eos_ids:
                eos_pos = p
    assert res.stats.nfe + again.stats.nfe == n_calls, f"{ctx}: NFE {res.stats.nfe} + {again.stats.nfe} != {n_calls} model calls"
    assert again.token_ids == ids, f"{ctx}: decoded {again.token_ids} the second time"
    positions = [p for c in commits for p in c.positions]
    assert positions == list(range(len(prompt), len(prompt) + len(ids))), f"{ctx}: commits at positions {positions}"
    assert [t for c in commits for t in c.token_ids] == ids, f"{ctx}: streamed {[c.token_ids for c in commits]}"
    got = [r.token_ids for r in batch]
    assert got == [ids, alone_other.token_ids], (f"{ctx}: in a batch with prompt {other} the outputs are {got}, "
                                                 f"alone {[ids, alone_other.token_ids]}")


def check_decoder(name: str, max_examples: int | None = None, *, registry=None, parts: dict[str, list[str]] | None = None,
                  raise_on_failure: bool = True) -> CheckReport:
    """Check registered decoder ``name`` on a tiny random model of its attention kind, over configs drawn
    from the registry (:func:`~refusion.testing.strategies.decoder_configs`; ``parts`` limits the part
    names drawn per kind)."""
    from refusion.core.registry import get_registry

    reg = registry or get_registry()
    dec_cls = reg.get("decoder", name)
    bb = backbone(dec_cls.attention[0])

    def invariants(cfg, prompt, other, eos_at):
        decoder_invariants(bb, cfg, prompt, other, eos_at, reg)

    props = [(DECODER_INVARIANTS, invariants,
              dict(cfg=S.decoder_configs(name, reg, parts), prompt=S.prompts(), other=S.prompts(),
                   eos_at=st.one_of(st.none(), st.integers(0, S.MAX_GEN_LENGTH + 2))))]
    return base._run(CheckReport("decoder", name), props, max_examples, raise_on_failure)

