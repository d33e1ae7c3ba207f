"""Training that starts at scale, on CPU stand-ins: FSDP2 and DeepSpeed ZeRO-2/3 over two gloo processes
launched with the shipped accelerate configs (``-m scale``; slow), the DeepSpeed config the trainer writes
(validated by DeepSpeed itself), weights loaded once in their stored dtype, the tokenised store built once and
memory-mapped by later runs, and the training process group's timeout."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from datetime import timedelta
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import make_char_tokenizer
from safetensors.torch import load_file

pytest.importorskip("accelerate")

from refusion.models.build import build_model  # noqa: E402
from refusion.models.loading import load_pretrained, save_pretrained  # noqa: E402
from refusion.training import data as data_mod  # noqa: E402
from refusion.training.trainer import TrainConfig, read_log  # noqa: E402

CONFIGS = Path(str(files("refusion.training") / "accelerate_configs"))
pytestmark = pytest.mark.scale  # every check here; the launches are also slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, args: list[str], timeout: int = 240) -> dict:
    """``accelerate launch --config_file CONFIG -m refusion.training.distributed ARGS`` (2 CPU processes);
    returns the run's summary."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           "-m", "refusion.training.distributed", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    out = args[args.index("--out") + 1]
    return json.loads((Path(out) / "summary.json").read_text())


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A micro causal model stored in bfloat16 and a JSON of equal-length (query, response) pairs."""
    root = tmp_path_factory.mktemp("scale")
    tok = make_char_tokenizer()
    save_pretrained(build_model(tok, size="micro", seed=3), tok, root / "m")  # bf16 on disk
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        q = "".join(rng.choice("abcde") for _ in range(4))
        rows.append({"query": q, "response": f"copy {q}."})
    (root / "data.json").write_text(json.dumps(rows))
    return root


def common_args(micro: Path, out: Path, *extra: str) -> list[str]:
    # AR on equal-length examples: no objective noise, so the loss of a global batch of 8 does not depend on
    # how it is split over processes and micro-batches
    return ["--objective", "ar", "--init", str(micro / "m"), "--data", str(micro / "data.json"), "--steps", "3",
            "--batch-size", "8", "--lr", "3e-3", "--log-every", "1", "--threads", "1", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def one_process(micro, tmp_path_factory):
    """The same run in one process (float32): the reference of the distributed runs."""
    from refusion.training.distributed import main

    out = tmp_path_factory.mktemp("one") / "run"
    assert main(common_args(micro, out)) == 0
    return out


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(out) if r["kind"] == "train"}


def run_in_two_launches(config: str, micro: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    """Steps 1-2, stopped (state saved), then a second launch that resumes for step 3."""
    first = launch(config, common_args(micro, out, "--stop-at", "2", *extra))
    assert first["steps"] == 2 and not first["finished"]
    second = launch(config, common_args(micro, out, "--resume", *extra))
    assert second["steps"] == 3 and second["finished"]
    log = read_log(out)
    assert [r["step"] for r in log if r["kind"] == "start"] == [0, 2]  # resumed, not restarted
    assert sorted(train_losses(out)) == [1, 2, 3]
    # the data were tokenised once, by rank 0, then memory-mapped: the resumed run tokenised nothing
    assert first["data"]["tokenized_by_ranks"] == [0] and second["data"]["tokenized_by_ranks"] == []
    assert first["data"]["store"] == second["data"]["store"]
    return first, second


# ------------------------------------------------------------------------------------------ FSDP
@pytest.mark.slow
def test_fsdp2_two_cpu_processes_step_resume_and_match_one_process(micro, one_process, tmp_path):
    out = tmp_path / "fsdp"
    # float32 (--mixed-precision no) so that the sharded run can be compared with one process exactly
    first, second = run_in_two_launches("fsdp2_cpu2.yaml", micro, out, "--mixed-precision", "no")
    assert second["distributed"] == "FSDP" and second["processes"] == 2 and second["param_spread"] is None
    # weights: rank 0 read the bf16 checkpoint into host memory, rank 1 read nothing (meta) and got its shards
    w0, w1 = second["weights"]
    assert (w0["how"], w0["dtype"], w0["device"]) == ("rank0_host_then_shards", "bfloat16", "cpu") and w0["bytes"] > 0
    assert (w1["device"], w1["bytes"]) == ("meta", 0)
    # every step (the resumed one too) equals one process with the same global batch
    ref, got = train_losses(one_process), train_losses(out)
    for step in (1, 2, 3):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    a, b = load_file(one_process / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    init = load_file(micro / "m" / "model.safetensors")
    assert max(float((a[k].float() - init[k].float()).abs().max()) for k in a) > 1e-3  # training moved them
    for k in a:  # both bf16 on disk: equal up to one bf16 rounding step
        assert torch.allclose(a[k].float(), b[k].float(), atol=2e-4, rtol=0), k
    model, _ = load_pretrained(out)
    assert model.config.refusion_objective == "ar"


# ------------------------------------------------------------------------------------- DeepSpeed
@pytest.mark.slow
@pytest.mark.parametrize("config,precision", [("deepspeed_zero2_cpu2.yaml", "bf16"), ("deepspeed_zero3_cpu2.yaml", "no")])
def test_deepspeed_two_cpu_processes_step_and_resume(micro, one_process, tmp_path, config, precision):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds"
    extra = ("--mixed-precision", "no") if precision == "no" else ()
    first, second = run_in_two_launches(config, micro, out, *extra)
    stage = 3 if "zero3" in config else 2
    assert second["distributed"] == "DEEPSPEED" and second["grad_accum"] == 2  # the config's accumulation
    # the micro-batch was written into the DeepSpeed config (no dataloader went through prepare)
    assert second["deepspeed"] == {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                   "train_batch_size": 8, "gradient_clipping": 1.0, "zero_stage": stage,
                                   "bf16": precision == "bf16"}
    hows = {w["how"] for w in second["weights"]}
    if stage == 3:  # each rank kept its partition (half) of the weights as they loaded
        assert hows == {"zero3_partitioned"}
        assert second["weights"][0]["bytes"] == second["weights"][1]["bytes"] > 0
    else:  # straight to each rank's device, in the stored bf16
        assert hows == {"on_device"} and {w["dtype"] for w in second["weights"]} == {"bfloat16"}
    # the schedule stepped on the optimizer accelerate returned: the logged lr follows warmup + cosine
    from refusion.training.trainer import lr_lambda

    f = lr_lambda(TrainConfig(steps=3, lr=3e-3))
    assert [r["lr"] for r in read_log(out) if r["kind"] == "train"] == pytest.approx([3e-3 * f(s) for s in range(3)])
    ref, got = train_losses(one_process), train_losses(out)
    tol = 1e-5 if precision == "no" else 2e-3  # float32 ZeRO equals one process; bf16 is close
    for step in (1, 2, 3):
        assert got[step] == pytest.approx(ref[step], rel=tol), step
    model, _ = load_pretrained(out)  # the final model, gathered (ZeRO-3: 16-bit) on rank 0
    assert model.config.refusion_objective == "ar"


# -------------------------------------------------------------------------- DeepSpeed config (fast)
def _ds_plugin_from_yaml(name: str):
    from accelerate import DeepSpeedPlugin
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(CONFIGS / name))
    return DeepSpeedPlugin(**cfg.deepspeed_config), cfg


@pytest.mark.parametrize("name", ["deepspeed_zero2_8gpu.yaml", "deepspeed_zero3_8gpu.yaml",
                                  "deepspeed_zero2_cpu2.yaml", "deepspeed_zero3_cpu2.yaml"])
def test_deepspeed_config_gets_the_micro_batch_and_validates(name, monkeypatch):
    """The shipped configs leave the batch to the trainer ("auto"); configure_deepspeed fills it from the
    global batch, the processes and the accumulation, and DeepSpeed's own config check accepts the result."""
    ds = pytest.importorskip("deepspeed")
    from deepspeed.runtime import config as ds_config

    from refusion.training.distributed import configure_deepspeed

    plugin, cluster = _ds_plugin_from_yaml(name)
    world, accum = cluster.num_processes, int(cluster.deepspeed_config["gradient_accumulation_steps"])
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"  # what used to stop the run
    acc = SimpleNamespace(distributed_type="DistributedType.DEEPSPEED", num_processes=world,
                          state=SimpleNamespace(deepspeed_plugin=plugin))
    batch = 512 if world == 8 else 8
    cfg = configure_deepspeed(acc, TrainConfig(batch_size=batch, grad_clip=1.0), accum)
    assert cfg["train_micro_batch_size_per_gpu"] == batch // (world * accum)
    assert cfg["train_batch_size"] == batch and cfg["gradient_accumulation_steps"] == accum
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world)
    checked = ds.runtime.config.DeepSpeedConfig(dict(cfg))
    assert (checked.train_micro_batch_size_per_gpu, checked.gradient_accumulation_steps,
            checked.train_batch_size) == (batch // (world * accum), accum, batch)
    # a config that contradicts the run is refused, naming the key
    acc.state.deepspeed_plugin, _ = _ds_plugin_from_yaml("deepspeed_zero2_8gpu.yaml")  # accumulation 16
    with pytest.raises(ValueError, match="the DeepSpeed config sets gradient_accumulation_steps=16"):
        configure_deepspeed(acc, TrainConfig(batch_size=batch), 4)
    assert configure_deepspeed(SimpleNamespace(distributed_type="DistributedType.MULTI_GPU"), TrainConfig(), 1) is None


def test_grad_accum_that_contradicts_the_config_is_refused_and_the_group_waits_long(monkeypatch):
    """accelerate silently takes the config's accumulation over the argument: make_accelerator refuses the
    contradiction; the process group is joined with the long training timeout."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from refusion.training.distributed import DIST_TIMEOUT_MIN, make_accelerator

    def fresh():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    fresh()
    try:
        acc = make_accelerator(grad_accum=2)
        assert acc.gradient_accumulation_steps == 2
        assert acc.init_handler.timeout == timedelta(minutes=DIST_TIMEOUT_MIN) >= timedelta(hours=3)
        fresh()
        monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "16")  # as accelerate launch sets it
        with pytest.raises(ValueError, match="--grad-accum 2 contradicts .* gradient_accumulation_steps \\(16\\)"):
            make_accelerator(grad_accum=2)
        fresh()
        assert make_accelerator(grad_accum=None).gradient_accumulation_steps == 16  # left out: the config's
    finally:
        fresh()


# --------------------------------------------------------------------------------- weights (fast)
def test_weights_load_in_their_stored_dtype_straight_to_the_device(micro, tmp_path, monkeypatch):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from refusion.training.distributed import load_for_training, storage_dtype

    calls = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *a, **k):
        calls.append(k)
        return real(cls, *a, **k)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    acc = Accelerator(cpu=True)
    assert storage_dtype(micro / "m") == torch.bfloat16
    model, tok, info = load_for_training(micro / "m", acc)
    assert calls[-1]["dtype"] == torch.bfloat16 and calls[-1]["device_map"] == {"": "cpu"}  # one load, no fp32 copy
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert info == {"rank": 0, "how": "on_device", "dtype": "bfloat16", "device": "cpu",
                    "bytes": sum(p.numel() * 2 for p in model.parameters())}
    assert tok.mask_token_id is not None
    f32 = tmp_path / "f32"
    save_pretrained(build_model(make_char_tokenizer(), size="micro"), make_char_tokenizer(), f32, dtype=torch.float32)
    model, _, info = load_for_training(f32, acc)
    assert info["dtype"] == "float32" and calls[-1]["dtype"] == torch.float32


# ----------------------------------------------------------------------------- token store (fast)
def test_the_token_store_is_built_once_and_memory_mapped_by_later_runs(micro, tmp_path, monkeypatch):
    import numpy as np

    tok = make_char_tokenizer()
    calls = []
    real = data_mod.encode_texts
    monkeypatch.setattr(data_mod, "encode_texts", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    data = micro / "data.json"
    folder, built = data_mod.tokenized_store(tmp_path, data, tok, max_length=64)
    assert built and sum(calls) == 64  # every example tokenised once (train + validation)
    store = data_mod.open_store(folder)
    assert list(store["train"]) == data_mod.load_pairs(data, tok, "train", max_length=64)
    assert store["validation"][:] == data_mod.load_pairs(data, tok, "validation", max_length=64)
    assert isinstance(store["train"].tokens, np.memmap) and isinstance(store["train"].index, np.memmap)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["splits"]["train"]["pairs"] == len(store["train"]) and meta["key"]["max_length"] == 64

    calls.clear()  # a second run (another process, or a rerun) maps the store: nothing is tokenised
    again, built = data_mod.tokenized_store(tmp_path, data, tok, max_length=64)
    assert (again, built, calls) == (folder, False, [])
    # another max length, prompt layout or data file is another store
    assert data_mod.tokenized_store(tmp_path, data, tok, max_length=32)[0] != folder
    assert data_mod.tokenized_store(tmp_path, data, tok, max_length=64, chat=True)[0] != folder
    rows = json.loads(data.read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps(rows[:-1]))
    assert data_mod.tokenized_store(tmp_path, other, tok, max_length=64)[0] != folder
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("pairs-")]) == 4
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # built beside, renamed into place


def test_shared_pairs_in_one_process_and_the_trainer_reads_the_store(micro, tmp_path):
    from accelerate import Accelerator

    from refusion.core.registry import build_registry, make_plugin_manager
    from refusion.training.distributed import DistributedTrainer, shared_pairs

    tok = make_char_tokenizer()
    acc = Accelerator(cpu=True)
    train, val, info = shared_pairs(acc, tmp_path / "cache", micro / "data.json", tok, 64)
    assert info["tokenized"] and isinstance(train, data_mod.PairStore)
    _, _, info = shared_pairs(acc, tmp_path / "cache", micro / "data.json", tok, 64)
    assert not info["tokenized"]
    objective = build_registry(make_plugin_manager(autoload=False)).get("objective", "mdm").from_tokenizer(tok)
    cfg = TrainConfig(steps=2, batch_size=4, lr=3e-3, progress=False, log_every=1, threads=None)
    model = build_model(tok, size="micro", attention="bidirectional", seed=1)
    trainer = DistributedTrainer(model, tok, objective, train, cfg, tmp_path / "run", accelerator=acc, val_pairs=val)
    assert trainer.scheduler.optimizer is trainer.optimizer  # the schedule sits on what prepare returned
    summary = trainer.train()
    assert summary["steps"] == 2 and summary["eval"]
    with pytest.raises(ValueError, match="longer than max_length=3"):
        shared_pairs(acc, tmp_path / "cache", micro / "data.json", tok, 3)
