"""A micro model trained inside the suite with the ReFusion objective really decodes in whole slots."""

from helpers import MICRO_SENTENCE

from refusion.core.config import build_decoder


def test_refusion_accepts_whole_slots_on_a_trained_micro_model(micro_refusion):
    bb = micro_refusion
    prompt = bb.tokenizer.encode("abc\n", add_special_tokens=False)
    res = build_decoder(bb, {"decoder": "refusion", "gen_length": 40, "slot_size": 4,
                             "selector": {"slot_threshold": 0.5}, "verifier": {"token_threshold": 0.5}}).generate(prompt)
    assert res.text.startswith(MICRO_SENTENCE)
    whole = [t for t in res.trace if t.stage == "II-a" and len(t.accepted) >= 2 and all(n == 4 for _, n in t.accepted)]
    assert whole, [(t.stage, t.accepted) for t in res.trace]  # several whole slots accepted by one verification
    assert res.stats.tpf > 2.0  # far more than one token per forward
