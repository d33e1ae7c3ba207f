"""Decoder invariants over a generated space of configurations, prompts and EOS placements."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import build_decoder
from refusion.core.registry import get_registry, set_registry
from refusion.core.types import DecodeState, Slot
from refusion.testing import check_decoder
from refusion.testing.strategies import decoder_configs, prompts

pytestmark = pytest.mark.property

DECODERS = get_registry().names("decoder")
set_registry(None)  # the suite's fixture builds a fresh registry per test


@pytest.fixture(scope="module")
def causal():
    """The tiny causal model check_decoder decodes with (built once per process and shared)."""
    from refusion.testing.checks import backbone

    return backbone("causal")


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_invariants(name):
    """For every registered decoder (an installed plugin's too) and every configuration drawn from the
    registry's parts and their options (refusion.testing.check_decoder): no [MASK] in the output; at most
    gen_length tokens; nothing after the first EOS, and an EOS forced at a generated position ends the output;
    every output position is committed once and restoring the buffer by position gives the output (a
    slot past the output is committed only before an EOS or as padding past gen_length); nothing is
    committed past the (padded) generation span, nor right of an EOS once that EOS is committed; NFE equals
    the forward calls counted by a hook on the model; the same seed decodes the same
    (temperature 0 or sampled); the streamed commits are the output; each sequence of a batch decodes as
    alone."""
    assert check_decoder(name).ok


@given(k=st.integers(1, 6), n=st.integers(1, 10), prompt_len=st.integers(1, 5), data=st.data())
def test_restore_by_position_inverts_any_reordering(k, n, prompt_len, data):
    """Committing slots in any order (each with its original position ids) and sorting by position gives
    back the tokens in their original order, for any slot size, length and permutation."""
    tokens = data.draw(st.lists(st.integers(0, 999), min_size=n * k, max_size=n * k))
    order = data.draw(st.permutations(range(n)))
    state = DecodeState(ids=list(range(prompt_len)), pos=list(range(prompt_len)), prompt_len=prompt_len)
    for s in order:
        slot = Slot(prompt_len + s * k, k)
        state.commit(tokens[s * k:(s + 1) * k], list(slot.positions))
    assert state.generated_in_position_order() == tokens


@given(cfg=decoder_configs("refusion", parts={"selector": ["threshold"], "cache": ["kv_concat"]}),
       prompt=prompts(max_size=6))
def test_kv_concat_equals_kv_recompute_with_one_slot_per_iteration(causal, cfg, prompt):
    """When exactly one slot is committed per iteration (top-1 fallback with slot_threshold 1), each
    completed slot's KV already has full context, so kv_concat and kv_recompute decode identically
    (the configuration's other parts drawn from the registry)."""
    bb = causal
    cfg = {**cfg, "selector": {"name": "threshold", "slot_threshold": 1.0}, "fused": False, "split_threshold": None}
    a = build_decoder(bb, {**cfg, "cache": "kv_concat"}).generate(prompt)
    b = build_decoder(bb, {**cfg, "cache": "kv_recompute"}).generate(prompt)
    assert a.token_ids == b.token_ids and a.stats.nfe == b.stats.nfe


def test_the_decoder_invariants_catch_a_decoder_that_decodes_past_a_committed_eos(causal):
    """A ReFusion loop that forgets to drop the pool slots after a committed EOS still returns the right text
    (the output is cut at the EOS), but decodes and commits the slots past it: wasted forwards that the
    decoder invariants' commit-order property catches (the shipped decoder commits a slot right of the EOS
    only before the EOS is found, as the reference does). One example, left to right, the EOS forced into
    the first slot (check_decoder finds such an example too, but shrinking it costs a minute of CPU)."""
    import types

    from refusion.core.hookspecs import hookimpl
    from refusion.core.registry import build_registry, make_plugin_manager
    from refusion.decoders.refusion import RefusionDecoder
    from refusion.testing import decoder_invariants

    class PastEos(RefusionDecoder):
        """Broken: keeps every pool slot after an EOS is committed, and decodes them."""

        name = "past_eos"

        @staticmethod
        def _retire(st, done, eos_slot):
            RefusionDecoder._retire(st, done, None)
            st.stop = st.stop or eos_slot is not None

    plugin = types.SimpleNamespace(register_decoders=hookimpl(lambda register: register("past_eos", PastEos)))
    registry = build_registry(make_plugin_manager([plugin], autoload=False))
    cfg = {"gen_length": 8, "slot_size": 2, "selector": "left_to_right"}
    decoder_invariants(causal, {"decoder": "refusion", **cfg}, [5, 6], [7], eos_at=0, registry=registry)
    with pytest.raises(AssertionError, match=r"position \d+ committed after an EOS was committed at 2 \(decoding past the EOS\)"):
        decoder_invariants(causal, {"decoder": "past_eos", **cfg}, [5, 6], [7], eos_at=0, registry=registry)
