"""Training settings: every default of a training option is defined once, in training/config.py, and each
command's flags, help and parsed settings come from it; --config and --set fill any field."""

import argparse

import pytest

from refusion.core.config import ConfigError
from refusion.core.flags import default_text
from refusion.training.config import DistributedRun, RecipeConfig, TrainConfig, TrainRun


def train_parser() -> argparse.ArgumentParser:
    from refusion.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def parsers():
    from refusion.training import distributed, recipe

    return [("refusion train", train_parser(), (TrainRun, RecipeConfig)),
            ("distributed", distributed.build_parser(), (DistributedRun,)),
            ("recipe", recipe.build_parser(), (RecipeConfig,))]


@pytest.mark.parametrize("name,parser,models", parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_each_command_line_default_is_the_config_models(name, parser, models):
    """Every flag that sets a field defaults to nothing of its own (the model's default applies) and its help
    states the model's default; only --threads (N|auto) is not generated, and it states the model's too."""
    fields = {n for m in models for n in m.model_fields}
    covered = set()
    for action in parser._actions:
        if action.dest not in fields:
            continue
        covered.add(action.dest)
        model = next(m for m in models if action.dest in m.model_fields)
        if action.dest == "threads" and action.default is None:  # refusion train: --threads N|auto
            assert action.default is None and f"default {default_text(model, 'threads')}" in action.help
            continue
        assert action.default is argparse.SUPPRESS, (name, action.dest, action.default)
        info = model.model_fields[action.dest]
        if info.annotation is bool:
            want = "(off; default on)" if action.option_strings[0].startswith("--no-") else \
                f"(default {'on' if info.default else 'off'})"
        else:
            want = "(required)" if info.is_required() else f"(default {default_text(model, action.dest)}"
        assert want in action.help, (name, action.dest, action.help)
    # every field is a flag, but the objective options (--set) and the distributed run's progress (always off)
    assert fields - covered <= {"options", "progress"}, fields - covered


def test_every_default_shared_by_the_models_is_defined_once():
    """A field of several models has one default, read from one place (the recipe's batch grouping differs
    by design: it is the recipe's own setting, and refusion train's help names both)."""
    for model in (TrainRun, DistributedRun, RecipeConfig):
        for name in set(model.model_fields) & set(TrainConfig.model_fields):
            if (model, name) in ((RecipeConfig, "group_by_length"),) or model.model_fields[name].is_required():
                continue
            assert default_text(model, name) == default_text(TrainConfig, name), (model.__name__, name)
    assert "(default 0; with --recipe 64)" in next(a.help for a in train_parser()._actions
                                                   if a.dest == "group_by_length")


def test_no_flags_give_the_models_defaults_and_layers_apply_in_order(tmp_path):
    """Defaults < --config file < flags < --set; a --set key that is not a field is an objective option;
    a bad value names its flag; a flag of the other mode is refused."""
    from refusion.training.cli import train_settings
    from refusion.training.distributed import build_parser as dist_parser, distributed_settings
    from refusion.training.recipe import build_parser as recipe_parser
    from refusion.core.flags import settings_from_args

    p = train_parser()
    assert train_settings(p.parse_args(["--out", "o"])) == TrainRun(out="o")
    assert train_settings(p.parse_args(["--recipe", "tiny", "--out", "o"])) == RecipeConfig(out="o")
    a = recipe_parser().parse_args(["--out", "o"])
    assert settings_from_args(RecipeConfig, a, config_file=a.config, sets=a.set) == RecipeConfig(out="o")
    run = distributed_settings(dist_parser().parse_args(["--init", "m", "--out", "o"]))
    assert run == DistributedRun(init="m", out="o", progress=False)

    cfg = tmp_path / "train.yaml"
    cfg.write_text("steps: 7\nlr: 0.01\nbetas: [0.8, 0.9]\noptions: {eps: 0.01}\n")
    got = train_settings(p.parse_args(["--out", "o", "--config", str(cfg), "--steps", "9", "--lr", "0.02",
                                       "--set", "lr=0.03", "--set", "slot_sizes=[4, 8]", "--threads", "1"]))
    assert (got.steps, got.lr, got.betas, got.threads) == (9, 0.03, (0.8, 0.9), 1)
    assert got.options == {"eps": 0.01, "slot_sizes": [4, 8]}
    assert got.loop_config() == TrainConfig(**{k: getattr(got, k) for k in TrainConfig.model_fields})
    assert train_settings(p.parse_args(["--out", "o", "--betas", "0.9,0.999"])).betas == (0.9, 0.999)
    with pytest.raises(ConfigError, match="--batch-size: Input should be greater than or equal to 1"):
        train_settings(p.parse_args(["--out", "o", "--batch-size", "0"]))
    with pytest.raises(ConfigError, match="--jobs: --recipe tiny only"):
        train_settings(p.parse_args(["--out", "o", "--jobs", "2"]))
    with pytest.raises(ConfigError, match="--steps: --objective training only"):
        train_settings(p.parse_args(["--recipe", "tiny", "--out", "o", "--steps", "2"]))


def test_workers_receive_their_settings_as_a_written_file(tmp_path, monkeypatch):
    """A call written for a worker comes back with the same types: a pydantic model, paths, tuples."""
    from refusion.core import workers

    spec = workers.write_call(tmp_path / "call.json", dict, {"config": RecipeConfig(out="o", seed=3),
                                                             "out": tmp_path, "shard": (1, 2), "names": ["a"]},
                              threads=None)  # a worker sets its torch threads; this process keeps its own
    assert workers.run_call(spec) == {"config": RecipeConfig(out="o", seed=3), "out": tmp_path, "shard": (1, 2),
                                      "names": ["a"]}
