"""The controlled recipe: stages run once, fine-tunes share the pretrained base, workers in parallel."""

import json
from pathlib import Path

import pytest

from refusion.training.recipe import SUMMARY_FILE, report, run_recipe


def test_recipe_runs_stages_once_and_fine_tunes_in_parallel_workers(tmp_path):
    out = tmp_path / "recipe"
    kw = dict(pretrain_steps=2, finetune_steps=1, refine_steps=2, base_ar_steps=0, refine_rounds=1, batch_size=4,
              size="micro", objectives=("refusion", "ar"), threads=1, progress=False, train_limit=48, jobs=2)
    summary = run_recipe(out, **kw)
    stages = summary["stages"]
    assert list(stages) == ["tokenizer", "pretrain", "finetune-refusion", "refine-refusion", "finetune-ar", "refine-ar"]
    assert [stages[s]["steps"] for s in ("pretrain", "finetune-refusion", "refine-refusion")] == [2, 1, 2]
    assert "masked_acc" in stages["finetune-refusion"]["eval"]  # diffusion objectives report masked accuracy
    for name in ("refusion", "ar"):  # the refine stage starts from the kept F-step model, ends in micro-<name>
        assert (out / "work" / f"finetune-{name}" / "model" / "model.safetensors").is_file()
        assert stages[f"refine-{name}"]["output"] == str(out / f"micro-{name}")
    for name in ("micro-base", "micro-refusion", "micro-ar"):
        assert (out / name / "model.safetensors").is_file() and (out / name / "tokenizer.json").is_file()
    assert sorted(p.name for p in (out / "work").glob("finetune-*.log")) == ["finetune-ar.log", "finetune-refusion.log"]
    assert json.loads((out / SUMMARY_FILE).read_text())["stages"].keys() == stages.keys()
    again = run_recipe(out, **kw)  # everything done: nothing retrains, same stage results
    assert again["stages"] == stages
    table = report(out)
    assert "| finetune-refusion | refusion | 1 |" in table and "| pretrain | ar | 2 |" in table
    assert "| refine-ar | ar | 2 |" in table


def test_fine_tune_workers_get_the_recipes_device(tmp_path, monkeypatch):
    """Each worker receives the recipe's settings, the device included (the GPU run of the shipped
    checkpoints used it), for its one objective, as a written file."""
    from refusion.core import workers
    from refusion.training.config import RecipeConfig
    from refusion.training.recipe import run_finetune_jobs

    seen = []
    monkeypatch.setattr(workers, "run_jobs", lambda jobs, n: seen.extend(jobs) or [])
    cfg = RecipeConfig(out=str(tmp_path), pretrain_steps=10, finetune_steps=5, batch_size=4, base_ar_steps=0,
                       size="micro", device="cuda:1")
    run_finetune_jobs(cfg, ["refusion", "block"], 2)
    assert [j.name for j in seen] == ["refusion", "block"]
    for job in seen:
        assert job.cmd[1:3] == ["-m", "refusion.core.workers"]
        call = workers.decode(__import__("json").loads(Path(job.cmd[3]).read_text())["kwargs"])
        assert call["config"] == cfg.model_copy(update={"objectives": (job.name,), "threads": 1, "jobs": 1,
                                                         "progress": False})


def test_base_ar_stage_trains_the_base_further_and_replaces_it(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "recipe"
    kw = dict(pretrain_steps=2, finetune_steps=1, base_ar_steps=2, refine_steps=0, batch_size=4, size="micro",
              objectives=("refusion",), threads=1, progress=False, train_limit=48)
    stages = run_recipe(out, **kw)["stages"]
    assert list(stages) == ["tokenizer", "pretrain", "base-ar", "finetune-refusion"]
    assert stages["base-ar"]["steps"] == 2 and stages["base-ar"]["output"] == str(out / "micro-base")
    phase1 = load_file(out / "work" / "pretrain" / "model" / "model.safetensors")  # the P-step base, kept
    base = load_file(out / "micro-base" / "model.safetensors")
    assert any(not phase1[k].equal(base[k]) for k in base)  # micro-base is the trained-further model
    assert run_recipe(out, **kw)["stages"] == stages  # done: nothing retrains
    assert "| base-ar | ar | 2 |" in report(out)


def test_mdm_trains_on_random_batches_the_others_on_length_grouped_ones(tmp_path):
    """mdm's EOS padding to the batch's longest response needs batches of mixed lengths (LLaDA's SFT)."""
    from refusion.training.recipe import GROUP_BY_LENGTH

    kw = dict(pretrain_steps=1, finetune_steps=1, refine_steps=1, base_ar_steps=0, refine_rounds=1, batch_size=4,
              size="micro", objectives=("mdm", "block"), threads=1, progress=False, train_limit=48)
    stages = run_recipe(tmp_path / "recipe", **kw)["stages"]
    grouping = {name: st["group_by_length"] for name, st in stages.items() if "group_by_length" in st}
    assert grouping == {"pretrain": GROUP_BY_LENGTH, "finetune-mdm": 0, "refine-mdm": 0,
                        "finetune-block": GROUP_BY_LENGTH, "refine-block": GROUP_BY_LENGTH}


def test_refine_rounds_chain_stages_each_from_the_one_before(tmp_path):
    """Round r trains R steps from round r - 1's model (kept), data order seeded seed + r; rerunning with more
    rounds trains only the new ones."""
    from safetensors.torch import load_file

    from refusion.training.recipe import refine_stage

    out = tmp_path / "recipe"
    kw = dict(pretrain_steps=1, finetune_steps=1, refine_steps=2, base_ar_steps=0, batch_size=4, size="micro",
              objectives=("refusion",), threads=1, progress=False, train_limit=48)
    one = run_recipe(out, refine_rounds=1, **kw)["stages"]
    assert refine_stage("refusion", 1) == "refine-refusion" and refine_stage("refusion", 3) == "refine3-refusion"
    summary = run_recipe(out, refine_rounds=3, **kw)
    stages = summary["stages"]
    assert summary["refine_rounds"] == 3
    assert list(stages) == ["tokenizer", "pretrain", "finetune-refusion", "refine-refusion", "refine2-refusion",
                            "refine3-refusion"]
    assert stages["refine-refusion"] == one["refine-refusion"]  # round 1 was done before: not retrained
    round1 = load_file(out / "work" / "refine-refusion" / "model" / "model.safetensors")  # kept for round 2
    round2 = load_file(out / "work" / "refine2-refusion" / "model" / "model.safetensors")
    final = load_file(out / "micro-refusion" / "model.safetensors")
    assert any(not round1[k].equal(round2[k]) for k in final) and any(not round2[k].equal(final[k]) for k in final)
    assert [stages[refine_stage("refusion", r)]["steps"] for r in (1, 2, 3)] == [2, 2, 2]
    assert [stages[refine_stage("refusion", r)]["seed"] for r in (1, 2, 3)] == [1, 2, 3]  # data order seed + r
    assert run_recipe(out, refine_rounds=3, **kw)["stages"] == stages  # done: nothing retrains
    with pytest.raises(ValueError, match="refine_rounds"):
        run_recipe(out, refine_rounds=0, **kw)
    with pytest.raises(ValueError, match="mix_from must be a refine round >= 1, or 0 for never; got -1"):
        run_recipe(out, refine_rounds=3, mix_from=-1, **kw)


def test_refusion_arm_trains_with_long_slots_and_every_arm_on_the_mix_from_the_given_rounds(tmp_path, monkeypatch):
    """objective_options: from round long_slots_from on, the refusion arm's slot sizes are LONG_SLOT_SIZES;
    earlier rounds and the other arms keep their objective's defaults. stage_data: from round mix_from on,
    every arm trains on LATE_MIX. Each stage records its options and data."""
    from refusion.training import recipe
    from refusion.training.recipe import LONG_SLOT_SIZES, objective_options, refine_stage, stage_data

    assert objective_options("refusion", 0, 2) is None and objective_options("refusion", 1, 2) is None
    assert objective_options("refusion", 2, 2) == {"slot_sizes": LONG_SLOT_SIZES}
    assert objective_options("refusion", 9, 0) is None and objective_options("ar", 9, 2) is None
    assert stage_data(1, 2) == "tinybench" and stage_data(2, 2) == recipe.LATE_MIX and stage_data(9, 0) == "tinybench"
    monkeypatch.setattr(recipe, "LATE_MIX", "tinybench:arith=2")  # the first 48 train examples are arith
    kw = dict(pretrain_steps=1, finetune_steps=1, refine_steps=1, base_ar_steps=0, refine_rounds=2, batch_size=4,
              size="micro", objectives=("refusion", "ar"), threads=1, progress=False, train_limit=48)
    summary = run_recipe(tmp_path / "recipe", long_slots_from=2, mix_from=2, **kw)
    stages = summary["stages"]
    sizes = {r: stages[refine_stage("refusion", r)]["options"]["slot_sizes"] for r in (1, 2)}
    assert sizes == {1: [4, 8, 16, 32], 2: LONG_SLOT_SIZES} and summary["long_slots_from"] == 2
    for name in ("refusion", "ar"):
        rounds = [stages[refine_stage(name, r)] for r in (1, 2)]
        assert [(st["data"], st["train_examples"]) for st in rounds] == [("tinybench", 48), ("tinybench:arith=2", 96)]


def test_summary_writes_from_concurrent_writers_never_collide(tmp_path):
    """Fine-tune workers write recipe_summary.json at the same time; a shared temporary name made one fail."""
    from concurrent.futures import ThreadPoolExecutor

    from refusion.training.recipe import _write_json

    path = tmp_path / SUMMARY_FILE
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _write_json(path, {"writer": i, "pad": "x" * 20000}), range(400)))
    assert json.loads(path.read_text())["pad"] == "x" * 20000
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]  # no temporary file left behind


def test_adopt_stage_takes_a_run_made_with_the_stage_settings_and_refuses_others(tmp_path):
    """A `refusion train` run with round 2's settings becomes refine2-refusion (the recipe then skips it); a
    run whose settings differ is refused, naming the field."""
    from refusion.cli import main
    from refusion.training.recipe import adopt_stage

    out = tmp_path / "recipe"
    kw = dict(pretrain_steps=1, finetune_steps=1, refine_steps=2, base_ar_steps=0, batch_size=4, size="micro",
              objectives=("refusion",), threads=1, progress=False, train_limit=48)
    run_recipe(out, refine_rounds=1, **kw)
    round1 = (out / "micro-refusion" / "model.safetensors").read_bytes()

    def train(run, seed):
        assert main(["train", "--objective", "refusion", "--init", str(out / "micro-refusion"), "--out", str(run),
                     "--steps", "2", "--batch-size", "4", "--lr", "5e-4", "--warmup", "1", "--group-by-length",
                     "64", "--seed", str(seed), "--limit", "48", "--threads", "1", "--no-progress"]) == 0

    train(tmp_path / "wrong", seed=7)
    adopt = dict(size="micro", batch_size=4, refine_steps=2, train_limit=48)
    with pytest.raises(ValueError, match="seed: run 7, stage 2"):
        adopt_stage(out, "refine2-refusion", tmp_path / "wrong", **adopt)
    with pytest.raises(ValueError, match="train_examples: run 48, stage 40"):  # other training data
        adopt_stage(out, "refine2-refusion", tmp_path / "wrong", **{**adopt, "train_limit": 40})
    with pytest.raises(ValueError, match="refine3-refusion follows refine2-refusion, which is not done"):
        adopt_stage(out, "refine3-refusion", tmp_path / "wrong", **adopt)
    train(tmp_path / "run", seed=2)
    done = adopt_stage(out, "refine2-refusion", tmp_path / "run", **adopt)
    assert done["adopted_from"] == str(tmp_path / "run") and done["seed"] == 2 and done["steps"] == 2
    assert (out / "work" / "refine-refusion" / "model" / "model.safetensors").read_bytes() == round1  # kept
    adopted = (tmp_path / "run" / "model.safetensors").read_bytes()
    assert (out / "micro-refusion" / "model.safetensors").read_bytes() == adopted
    assert run_recipe(out, refine_rounds=2, **kw)["stages"]["refine2-refusion"] == done  # skipped, not retrained


@pytest.mark.parametrize("flag,value,field", [("--refine-rounds", "0", "refine_rounds"),
                                              ("--mix-from", "-2", "mix_from"),
                                              ("--long-slots-from", "-1", "long_slots_from")])
def test_both_command_lines_name_a_bad_round_setting_and_exit_2_before_any_work(tmp_path, capsys, flag, value, field):
    from refusion.cli import main as refusion_main
    from refusion.training.recipe import main as recipe_main

    out = tmp_path / "never"
    assert refusion_main(["train", "--recipe", "tiny", "--out", str(out), flag, value]) == 2
    assert f"error: {field} must be" in capsys.readouterr().err
    assert recipe_main(["--out", str(out), flag, value]) == 2
    assert f"error: {field} must be" in capsys.readouterr().err
    assert not out.exists()
