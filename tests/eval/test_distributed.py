"""Data parallelism with two CPU processes (torchrun + gloo, as accelerate launches them on GPUs):
evaluation (each rank decodes its shard; the gathered results equal one process's) and training
(DDP keeps the ranks' weights identical and equals one process with the same global batch)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_char_tokenizer
from safetensors.torch import load_file

pytest.importorskip("accelerate")

from refusion.models.build import build_model  # noqa: E402
from refusion.models.loading import save_pretrained  # noqa: E402
from refusion.training.data import load_pairs  # noqa: E402
from refusion.training.trainer import TrainConfig, Trainer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int = 2, timeout: int = 150) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m ARGS`` on this machine (gloo on CPU), one thread per process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return r


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A micro causal model (float32 on disk) and a JSON of equal-length (query, response) pairs."""
    root = tmp_path_factory.mktemp("dp")
    tok = make_char_tokenizer()
    save_pretrained(build_model(tok, size="micro", seed=3), tok, root / "m", dtype=torch.float32)
    rng = random.Random(0)
    rows = []
    for _ in range(64):  # every example has the same token count: token means equal per-example means
        q = "".join(rng.choice("abcde") for _ in range(4))
        rows.append({"query": q, "response": f"copy {q}."})
    (root / "data.json").write_text(json.dumps(rows))
    return root


# ----------------------------------------------------------------------------------- evaluation
def test_two_process_evaluation_gathers_the_single_process_results(micro, tmp_path):
    pytest.importorskip("lm_eval")
    from refusion.eval.cli import main

    common = ["--model", str(micro / "m"), "--tasks", "tinybench_facts", "--limit", "4",
              "--tinybench-n", "4", "--decoder", "refusion", "--set", "gen_length=8", "--set", "slot_size=4",
              "--gen-length-from", "config", "--device", "cpu", "--log-samples"]
    torchrun(["refusion.eval", *common, "--output", str(tmp_path / "dp.json")])
    assert main([*common, "--output", str(tmp_path / "one.json")]) == 0
    dp, one = (json.loads((tmp_path / f).read_text()) for f in ("dp.json", "one.json"))
    assert dp["refusion"]["world_size"] == 2 and one["refusion"]["world_size"] == 1
    assert sorted(r["rank"] for r in dp["refusion"]["records"]) == [0, 0, 1, 1]  # 4 documents strided over 2 ranks
    for task in ("tinybench_facts",):
        by_doc = lambda res: {s["doc_id"]: (s["filtered_resps"], s["acc"]) for s in res["samples"][task]}  # noqa: E731
        assert by_doc(dp) == by_doc(one) and len(by_doc(dp)) == 4
        assert dp["results"][task]["acc,none"] == one["results"][task]["acc,none"]


# ------------------------------------------------------------------------------------- training
def test_one_process_distributed_trainer_reproduces_the_trainer(micro, tmp_path):
    from accelerate import Accelerator

    from refusion.core.registry import build_registry, make_plugin_manager
    from refusion.training.distributed import DistributedTrainer

    tok = make_char_tokenizer()
    pairs = load_pairs(str(micro / "data.json"), tok, "train")
    objective = build_registry(make_plugin_manager(autoload=False)).get("objective", "refusion").from_tokenizer(tok)
    cfg = TrainConfig(steps=4, batch_size=8, lr=3e-3, progress=False, log_every=2, threads=None)
    a, b = build_model(tok, size="micro", seed=5), build_model(tok, size="micro", seed=5)
    Trainer(a, tok, objective, pairs, cfg, tmp_path / "a").train()
    summary = DistributedTrainer(b, tok, objective, pairs, cfg, tmp_path / "b", accelerator=Accelerator(cpu=True)).train()
    assert summary["processes"] == 1 and summary["param_spread"] == 0.0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
    assert (tmp_path / "b" / "model.safetensors").is_file() and (tmp_path / "b" / "train_log.jsonl").is_file()


def test_two_process_ddp_training_matches_one_process_with_the_global_batch(micro, tmp_path):
    args = ["--objective", "ar", "--init", str(micro / "m"), "--data", str(micro / "data.json"), "--steps", "3",
            "--batch-size", "8", "--lr", "3e-3", "--log-every", "1", "--threads", "1"]
    # 2 processes x 2 accumulated micro-batches of 2 examples = the same global batch of 8
    torchrun(["refusion.training.distributed", *args, "--grad-accum", "2", "--out", str(tmp_path / "dp")])
    summary = json.loads((tmp_path / "dp" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["grad_accum"] == 2 and summary["steps"] == 3
    assert summary["param_spread"] == 0.0  # DDP kept both ranks' weights identical
    log = [json.loads(line) for line in (tmp_path / "dp" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "train"] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log if r["kind"] == "train")

    from refusion.training.distributed import main

    assert main([*args, "--out", str(tmp_path / "one")]) == 0  # one process, the same global batch of 8
    w2 = load_file(tmp_path / "dp" / "accelerate_state" / "model.safetensors")
    w1 = load_file(tmp_path / "one" / "accelerate_state" / "model.safetensors")
    assert w1.keys() == w2.keys()
    init = load_file(micro / "m" / "model.safetensors")
    assert max(float((w1[k] - init[k]).abs().max()) for k in init if k in w1) > 1e-3  # training moved the weights
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-5), (k, float((w1[k] - w2[k]).abs().max()))


def test_distributed_trainer_resumes_exactly(micro, tmp_path):
    from accelerate import Accelerator

    from refusion.core.registry import build_registry, make_plugin_manager
    from refusion.training.distributed import DistributedTrainer

    tok = make_char_tokenizer()
    pairs = load_pairs(str(micro / "data.json"), tok, "train")
    objective = build_registry(make_plugin_manager(autoload=False)).get("objective", "mdm").from_tokenizer(tok)
    cfg = TrainConfig(steps=4, batch_size=8, lr=3e-3, progress=False, log_every=1, threads=None)
    acc = lambda: Accelerator(cpu=True)  # noqa: E731  (one accelerator per trainer: it holds the prepared objects)
    straight = build_model(tok, size="micro", attention="bidirectional", seed=2)
    DistributedTrainer(straight, tok, objective, pairs, cfg, tmp_path / "a", accelerator=acc()).train()
    first = build_model(tok, size="micro", attention="bidirectional", seed=2)
    DistributedTrainer(first, tok, objective, pairs, cfg, tmp_path / "b", accelerator=acc()).train(stop_at=2)
    second = build_model(tok, size="micro", attention="bidirectional", seed=7)  # weights come from the state
    DistributedTrainer(second, tok, objective, pairs, cfg, tmp_path / "b", accelerator=acc()).train(resume=True)
    for (name, pa), pb in zip(straight.named_parameters(), second.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 4


def test_accelerate_config_files_parse():
    from importlib.resources import files

    from accelerate.commands.config.config_args import ClusterConfig

    folder = files("refusion.training") / "accelerate_configs"
    kinds = {p.name: str(ClusterConfig.from_yaml_file(str(p)).distributed_type).split(".")[-1]
             for p in Path(str(folder)).glob("*.yaml")}
    assert kinds == {"ddp_8gpu.yaml": "MULTI_GPU", "fsdp_8gpu.yaml": "FSDP", "deepspeed_zero3_8gpu.yaml": "DEEPSPEED",
                     "deepspeed_zero2_8gpu.yaml": "DEEPSPEED", "fsdp2_8gpu.yaml": "FSDP",
                     "eval_8gpu.yaml": "MULTI_GPU", "fsdp2_cpu2.yaml": "FSDP", "deepspeed_zero2_cpu2.yaml": "DEEPSPEED",
                     "deepspeed_zero3_cpu2.yaml": "DEEPSPEED"}


def test_evaluation_joins_the_process_group_with_lm_evals_long_timeout(monkeypatch):
    """Several eval processes wait on each other at the harness's barriers while the slowest finishes a long
    generative task: the group is joined with lm-eval's own HF model's timeout (52 weeks), not torch's default."""
    from datetime import timedelta

    from accelerate.state import PartialState

    from refusion.eval.lm_eval_adapter import PROCESS_GROUP_TIMEOUT, distributed_world

    class Joined(Exception):
        pass

    seen = []

    def init_process_group(*args, **kwargs):
        seen.append(kwargs)
        raise Joined  # stop here: nothing to join in this test

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                       "OMP_NUM_THREADS": str(torch.get_num_threads())}.items():  # else accelerate sets 1 thread
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    PartialState._reset_state()
    try:
        with pytest.raises(Joined):
            distributed_world(cpu=True)
    finally:
        PartialState._reset_state()
    assert PROCESS_GROUP_TIMEOUT == timedelta(weeks=52)
    assert seen and seen[0]["timeout"] == timedelta(weeks=52) and seen[0]["backend"] == "gloo"
