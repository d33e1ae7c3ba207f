import pytest

from refusion.core.config import ConfigError, apply_overrides, dump_config, load_config_file, validate_config


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"decoder": "refusion", "selector": {"slot_threshold": 1.5}}, "selector.slot_threshold"),
        ({"decoder": "refusion", "verifier": {"token_threshold": -0.1}}, "verifier.token_threshold"),
        ({"decoder": "refusion", "drafter": {"temperature": -1}}, "drafter.temperature"),
        ({"decoder": "refusion", "gen_length": 0}, "gen_length"),
        ({"decoder": "refusion", "slot_size": 0}, "slot_size"),
        ({"decoder": "refusion", "slot_sise": 4}, "slot_sise: unknown field"),
        ({"decoder": "refusion", "selector": {"name": "threshold", "treshold": 0.5}}, "selector.treshold: unknown field"),
        ({"decoder": "refusion", "scorer": "first_tok_prob"}, "scorer: unknown scorer 'first_tok_prob'; did you mean 'first_token_prob'"),
        ({"decoder": "refuson"}, "decoder: unknown decoder 'refuson'; did you mean 'refusion'"),
        ({"decoder": "refusion", "gen_length": 24, "slot_size": 4, "serial_blocks": 4}, "serial_blocks=4 must divide"),
        ({"gen_length": 24}, "decoder: missing"),
        ({"decoder": "ar", "scorer": "mean_prob"}, "scorer: unknown field"),
        ({"decoder": "refusion", "extender": {"token_threshold": 2}}, "extender.token_threshold"),
        ({"decoder": "ar", "extender": "prefix"}, "extender: unknown field"),
    ],
)
def test_invalid_config_names_the_field(cfg, field):
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert field in str(err.value)


def test_swapping_the_scorer_is_one_line():
    _, _, parts = validate_config({"decoder": "refusion", "scorer": "margin"})
    assert type(parts["scorer"]).__name__ == "Margin"
    assert type(parts["selector"]).__name__ == "ThresholdSelector"  # defaults kept


def test_yaml_toml_and_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("decoder: refusion\nslot_size: 4\nselector: {name: threshold, slot_threshold: 0.7}\n")
    (tmp_path / "c.toml").write_text('decoder = "refusion"\nslot_size = 4\n[selector]\nname = "threshold"\nslot_threshold = 0.7\n')
    a, b = load_config_file(tmp_path / "c.yaml"), load_config_file(tmp_path / "c.toml")
    assert a == b
    cfg = apply_overrides(a, ["selector.slot_threshold=0.5", "cache=kv_recompute", "verifier.token_threshold=0.3", "gen_length=64"])
    _, opts, parts = validate_config(cfg)
    assert parts["selector"].options.slot_threshold == 0.5
    assert parts["verifier"].options.token_threshold == 0.3
    assert type(parts["cache"]).__name__ == "KVRecompute"
    assert opts.gen_length == 64
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides(a, ["slot_size"])


def test_dump_round_trip():
    cfg = {"decoder": "refusion", "gen_length": 64, "slot_size": 4, "serial_blocks": 2, "scorer": "mean_prob",
           "selector": {"name": "threshold", "slot_threshold": 0.6}}
    _, opts, _ = validate_config(cfg)
    again = dump_config("refusion", opts)
    _, opts2, _ = validate_config(again)
    assert opts2 == opts


def test_a_config_from_standard_input(monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("decoder: refusion\nslot_size: 4\n"))
    assert load_config_file("-") == {"decoder": "refusion", "slot_size": 4}
    monkeypatch.setattr("sys.stdin", io.StringIO("- a list\n"))
    with pytest.raises(ConfigError, match="standard input must hold a mapping"):
        load_config_file("-")


def test_the_extender_takes_the_verifiers_threshold_unless_it_has_its_own():
    _, _, parts = validate_config({"decoder": "refusion", "verifier": {"token_threshold": 0.3}})
    assert type(parts["extender"]).__name__ == "PrefixExtender" and parts["extender"].options.token_threshold == 0.3
    assert validate_config({"decoder": "refusion"})[2]["extender"].options.token_threshold == 0.9
    _, opts, parts = validate_config({"decoder": "refusion", "verifier": {"token_threshold": 0.3},
                                      "extender": {"token_threshold": 0.6}})
    assert parts["verifier"].options.token_threshold == 0.3 and parts["extender"].options.token_threshold == 0.6
    assert dump_config("refusion", opts)["extender"] == {"name": "prefix", "token_threshold": 0.6}


@pytest.mark.parametrize("sets", [["selector.slot_threshold=1.5", "selector=threshold"],
                                  ["selector=threshold", "selector.slot_threshold=1.5"]])
def test_a_part_name_set_after_its_option_keeps_it(sets):
    """`--set selector=threshold` after `--set selector.slot_threshold=1.5` used to replace the mapping that
    held the option, so 1.5 passed validation; in either order it now reaches validation and is refused."""
    cfg = apply_overrides({"decoder": "refusion"}, sets)
    assert cfg["selector"] == {"name": "threshold", "slot_threshold": 1.5}
    with pytest.raises(ConfigError, match="selector.slot_threshold"):
        validate_config(cfg)


def test_overrides_keep_earlier_options_but_replace_the_files_part():
    base = {"decoder": "refusion", "selector": {"name": "threshold", "slot_threshold": 0.9}}
    assert apply_overrides(base, ["selector=left_to_right"])["selector"] == "left_to_right"  # the file's options go
    kept = apply_overrides(base, ["selector.slot_threshold=0.3", "selector=left_to_right"])
    assert kept["selector"] == {"name": "left_to_right", "slot_threshold": 0.3}  # refused by validation, by name
    with pytest.raises(ConfigError, match="selector.slot_threshold: unknown field"):
        validate_config(kept)
    assert apply_overrides({}, ["selector.slot_threshold=0.5", "selector={name: threshold, slot_threshold: 0.7}"]
                           )["selector"] == {"name": "threshold", "slot_threshold": 0.7}  # the later value wins
    with pytest.raises(ConfigError, match=r"--set 'gen_length=5' conflicts with --set 'gen_length.x=1'"):
        apply_overrides({}, ["gen_length.x=1", "gen_length=5"])
