"""docs/gpu.md, exercised on CPU stand-ins (``pytest -m scale``).

The page's evaluation path runs as written, with three substitutions: the checkpoints are stand-ins in
the real ones' formats (the shipped tiny-refusion for ReFusion-8B, tiny-ar for Qwen3-8B, tiny random
LLaDA and Dream checkpoints with their published tensor names and configs), the task reads a few
documents of the real dataset's format from a local file instead of the Hub, and ``--device cpu
--limit 2`` replace ``--device cuda`` and the whole test split. The fine-tuning path is exercised by
``tests/training/test_distributed_scale.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from refusion.cli import main  # noqa: E402
from refusion.eval.tasks.paper import TASKS_DIR  # noqa: E402
from refusion.models.tokenizer import CHAT_TEMPLATE  # noqa: E402

pytestmark = pytest.mark.scale
ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "gpu.md"
CONFIGS = ROOT / "src" / "refusion" / "eval" / "configs"
FIXTURES = Path(__file__).parent / "eval" / "fixtures" / "paper_tasks"


def bash_blocks() -> str:
    return "\n".join(re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S))


def test_every_task_and_config_the_page_names_exists():
    text = bash_blocks()
    pairs = re.findall(r"(\w+):(\w+)", text.split("for t in", 1)[1].split("; do", 1)[0])
    assert len(pairs) == 7
    shipped = {p.stem for p in TASKS_DIR.rglob("refusion_*.yaml")}
    for task, cfg in pairs:
        assert f"refusion_{task}" in shipped and (CONFIGS / f"{cfg}.yaml").is_file()
    for cfg in re.findall(r"/ckpt/[\w.-]+ (\w+)", text):  # the baselines' configs
        assert (CONFIGS / f"{cfg}.yaml").is_file(), cfg
    for folder in re.findall(r"accelerate_configs/([\w.]+\.yaml)", text):
        assert (ROOT / "src" / "refusion" / "training" / "accelerate_configs" / folder).is_file()


def local_task(directory: Path) -> Path:
    """refusion_gsm8k_cot as shipped, reading the gsm8k fixture (a user task of the same name wins)."""
    spec = {"include": str(next(TASKS_DIR.rglob("refusion_gsm8k_cot.yaml"))), "task": "refusion_gsm8k_cot",
            "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {"test": str(FIXTURES / "gsm8k.jsonl")},
                               "cache_dir": str(directory / "hf_cache")}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "refusion_gsm8k_cot.yaml").write_text(json.dumps(spec))
    return directory


def with_chat_template(folder: Path) -> Path:
    """The stand-in's tokenizer gets a chat template, as the real checkpoints' have."""
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    config.write_text(json.dumps(data))
    return folder


def test_refusion_and_the_baselines_then_the_table(tmp_path, capsys):
    from models.test_native import checkpoint

    tasks = local_task(tmp_path / "tasks")
    stand_ins = {  # the page's columns: (model, decoder config)
        "refusion": ("tiny-refusion", "gsm8k_cot"),
        "qwen3": ("tiny-ar", "qwen3_ar"),
        "llada": (with_chat_template(checkpoint(tmp_path, "llada")), "llada_instruct"),
        "llada-dual": (tmp_path / "llada", "llada_instruct_dual"),
        "dream-dual": (with_chat_template(checkpoint(tmp_path, "dream")), "llada_instruct_dual"),
    }
    common = ["--apply-chat-template", "--num-fewshot", "0", "--gen-length-from", "config", "--device", "cpu",
              "--limit", "2", "--include-path", str(tasks), "--set", "gen_length=128"]
    for name, (model, cfg) in stand_ins.items():
        extra = ["--set", "steps=128"] if cfg.startswith("llada") else []
        out = tmp_path / "out" / name / "gsm8k_cot.json"
        assert main(["eval", "--model", str(model), "--tasks", "refusion_gsm8k_cot", "--config",
                     str(CONFIGS / f"{cfg}.yaml"), *common, *extra, "--output", str(out)]) == 0, name
        result = json.loads(out.read_text())
        assert "exact_match,strict-match" in result["results"]["refusion_gsm8k_cot"]
        assert result["refusion"]["stats"]["tokens_per_second"] > 0
    folders = [str(tmp_path / "out" / n) for n in stand_ins]
    assert main(["eval-table", *folders, "--markdown", str(tmp_path / "table.md")]) == 0
    table = (tmp_path / "table.md").read_text()
    assert table.splitlines()[0] == "| task | " + " | ".join(stand_ins) + " |"
    assert table.count("tok/s") == len(stand_ins)
