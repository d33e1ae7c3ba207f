"""Config round trip: every valid config survives dump and load; every invalid field is rejected by name."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import ConfigError, dump_config, validate_config
from refusion.core.registry import get_registry, set_registry
from refusion.testing.strategies import decoder_configs

pytestmark = pytest.mark.property
DECODERS = get_registry().names("decoder")
set_registry(None)  # the suite's fixture builds a fresh registry per test

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


@pytest.mark.parametrize("decoder", DECODERS)
@given(data=st.data())
def test_dump_load_round_trip(decoder, data):
    """dump_config(validate_config(c)) validates back to the same options and the same parts, for every
    registered decoder with configs drawn from the registry's parts and their options."""
    cfg = data.draw(decoder_configs(decoder))
    _, opts, parts = validate_config(cfg)
    _, opts2, parts2 = validate_config(dump_config(decoder, opts))
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


# --set sequences: each value given reaches validation whatever the order (core/config.py apply_overrides)
tenths = st.integers(0, 10_000).map(lambda i: i / 10_000)  # floats that YAML reads back as written
OPTION_VALUES = {  # key -> (valid values, out-of-range values), each key an option of its part's `NAMES` part
    "selector.slot_threshold": (tenths, st.sampled_from([1.5, 2.0, -0.5])),
    "verifier.token_threshold": (tenths, st.sampled_from([1.01, 3.0, -0.1])),
    "drafter.temperature": (tenths, st.sampled_from([-1.0, -0.01])),
    "remasker.threshold": (tenths, st.sampled_from([1.5, -2.0])),
    "slot_size": (st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, -4])),
}
NAMES = {"selector": "threshold", "verifier": "prefix", "drafter": "gumbel", "remasker": "sub_slot",
         "scorer": None, "cache": None}
OTHER_NAMES = {"scorer": ["first_token_prob", "mean_prob", "margin"], "cache": ["kv_concat", "kv_recompute"]}
BASE = {"decoder": "refusion", "gen_length": 32}


@st.composite
def override_sequence(draw):
    """A list of (key, value) overrides: option values and part names in any order, a key given more than
    once now and then; every option's part named somewhere in the sequence (before or after it)."""
    options = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), max_size=6))
    seq = [(k, draw(OPTION_VALUES[k][0])) for k in options]
    for part in sorted({k.split(".")[0] for k in options if "." in k} | set(draw(st.sets(st.sampled_from(sorted(NAMES)))))):
        name = NAMES[part] or draw(st.sampled_from(OTHER_NAMES[part]))
        seq.insert(draw(st.integers(0, len(seq))), (part, name))
    return seq


def as_sets(seq) -> list[str]:
    return [f"{k}={v}" for k, v in seq]


def last_given(seq) -> dict:
    return {k: v for k, v in seq}


@given(seq=override_sequence())
def test_every_value_of_a_set_sequence_reaches_validation(seq):
    """Whatever the order of `--set` items (a part's name before or after its options), the validated
    config holds the last value given for every key."""
    from refusion.core.config import apply_overrides

    _, opts, parts = validate_config(apply_overrides(BASE, as_sets(seq)))
    for key, value in last_given(seq).items():
        if "." in key:
            part, option = key.split(".")
            assert getattr(parts[part].options, option) == value, key
        elif key in NAMES:
            assert getattr(opts, key).name == value, key
        else:
            assert getattr(opts, key) == value, key


@given(seq=override_sequence(), data=st.data())
def test_an_out_of_range_value_anywhere_in_a_set_sequence_is_refused_by_name(seq, data):
    """An out-of-range value put anywhere in a `--set` sequence (and not overridden later by the same key)
    fails validation naming its key: a part's name set after it never drops it."""
    from refusion.core.config import apply_overrides

    key = data.draw(st.sampled_from(sorted(OPTION_VALUES)))
    at = data.draw(st.integers(0, len(seq)))
    bad = (key, data.draw(OPTION_VALUES[key][1]))
    seq = seq[:at] + [bad] + [(k, v) for k, v in seq[at:] if k != key]
    part = key.split(".")[0]
    if "." in key and part not in dict(seq):  # the option's part, named somewhere
        seq.insert(data.draw(st.integers(0, len(seq))), (part, NAMES[part]))
    with pytest.raises(ConfigError) as err:
        validate_config(apply_overrides(BASE, as_sets(seq)))
    assert key in str(err.value)


@given(seq=override_sequence(), data=st.data())
def test_a_set_sequence_of_distinct_keys_means_the_same_in_any_order(seq, data):
    """With each key given once, the order of the `--set` items does not change the config."""
    from refusion.core.config import apply_overrides

    distinct = list(last_given(seq).items())
    shuffled = data.draw(st.permutations(distinct))
    assert apply_overrides(BASE, as_sets(shuffled)) == apply_overrides(BASE, as_sets(distinct))
