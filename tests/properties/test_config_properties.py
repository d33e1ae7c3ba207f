"""Config round trip: every valid config survives dump and load; every invalid field is rejected by name."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import ConfigError, dump_config, validate_config

pytestmark = pytest.mark.property

unit = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def valid_config(draw):
    k = draw(st.integers(1, 64))
    n_slots = draw(st.integers(1, 64))
    blocks = draw(st.sampled_from([d for d in range(1, n_slots + 1) if n_slots % d == 0]))
    return {
        "decoder": "refusion", "gen_length": n_slots * k, "slot_size": k, "serial_blocks": blocks,
        "seed": draw(st.integers(0, 2**31)), "fused": draw(st.booleans()),
        "split_threshold": draw(st.one_of(st.none(), unit)),
        "scorer": draw(st.sampled_from(["first_token_prob", "mean_prob", "mean_neg_entropy", "margin"])),
        "selector": draw(st.one_of(st.builds(lambda t: {"name": "threshold", "slot_threshold": t}, unit),
                                   st.just("left_to_right"))),
        "verifier": {"name": "prefix", "token_threshold": draw(unit)},
        "drafter": {"name": "gumbel", "temperature": draw(st.floats(0, 5, allow_nan=False))},
        "cache": draw(st.sampled_from(["kv_concat", "kv_recompute"])),
        "remasker": draw(st.one_of(st.just("none"), st.builds(lambda t: {"name": "sub_slot", "threshold": t}, unit))),
    }


@given(cfg=valid_config())
def test_dump_load_round_trip(cfg):
    """dump_config(validate_config(c)) validates back to the same options and the same parts."""
    _, opts, parts = validate_config(cfg)
    _, opts2, parts2 = validate_config(dump_config("refusion", opts))
    assert opts2 == opts
    assert {k: (type(p), p.options) for k, p in parts.items()} == {k: (type(p), p.options) for k, p in parts2.items()}


BAD = {
    "gen_length": st.one_of(st.integers(max_value=0), st.text(max_size=3)),
    "slot_size": st.integers(max_value=0),
    "selector.slot_threshold": st.one_of(st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False),
                                          st.floats(max_value=-0.0001, allow_nan=False, allow_infinity=False)),
    "verifier.token_threshold": st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False),
    "drafter.temperature": st.floats(max_value=-0.0001, allow_nan=False, allow_infinity=False),
    "remasker.threshold": st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False),
}


@given(cfg=valid_config(), field=st.sampled_from(sorted(BAD)), data=st.data())
def test_invalid_field_is_rejected_by_name(cfg, field, data):
    """Putting an out-of-range value in any one field makes validation fail with that field's dotted name."""
    value = data.draw(BAD[field])
    if "." in field:
        part, key = field.split(".")
        spec = cfg[part] if isinstance(cfg[part], dict) else {"name": cfg[part]}
        if part == "remasker":
            spec = {"name": "sub_slot"}
        cfg = {**cfg, part: {**spec, key: value}}
    else:
        cfg = {**cfg, field: value}
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert field in str(err.value)


@given(cfg=valid_config(), name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12))
def test_unknown_field_is_rejected_by_name(cfg, name):
    """Any field a decoder does not define is refused, named in the message."""
    from refusion.decoders.refusion import RefusionOptions

    if name in RefusionOptions.model_fields or name == "decoder":
        return
    with pytest.raises(ConfigError, match=f"{name}: unknown field"):
        validate_config({**cfg, name: 1})
