"""refusion eval-table: the paper's metric per task, one column per folder of eval outputs."""

import json

from refusion.cli import main


def write(path, task, metrics, tps):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": {task: {"alias": task, **metrics}},
                                "refusion": {"stats": {"tokens_per_second": tps, "tpf": 2.5}}}))


def test_eval_table_reads_each_folder_as_a_column(tmp_path, capsys):
    write(tmp_path / "refusion" / "gsm8k.json", "refusion_gsm8k_cot",
          {"exact_match,flexible-extract": 0.9, "exact_match,strict-match": 0.8, "exact_match_stderr,strict-match": 0.01},
          40.0)
    write(tmp_path / "refusion" / "mbpp.json", "refusion_mbpp", {"pass_at_1,none": 0.5}, 30.0)
    write(tmp_path / "qwen3" / "gsm8k.json", "refusion_gsm8k_cot", {"exact_match,strict-match": 0.85}, 10.0)
    (tmp_path / "qwen3" / "mmlu.json").write_text(json.dumps({"results": {
        "refusion_mmlu_pro": {"exact_match,custom-extract": 0.4},
        "refusion_mmlu_pro_law": {"exact_match,custom-extract": 0.2}}}))
    out = tmp_path / "table.md"
    assert main(["eval-table", str(tmp_path / "refusion"), str(tmp_path / "qwen3"), "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "| task | refusion | qwen3 |" in text
    assert "| refusion_gsm8k_cot | 80.0 (40.0 tok/s, TPF 2.50) | 85.0 (10.0 tok/s, TPF 2.50) |" in text  # strict-match
    assert "| refusion_mbpp | 50.0 (30.0 tok/s, TPF 2.50) |  |" in text
    assert "| refusion_mmlu_pro |  | 40.0 |" in text and "mmlu_pro_law" not in text  # the group, not its subtasks
    assert main(["eval-table", str(tmp_path / "none")]) == 2
    assert "no refusion eval --output JSON files" in capsys.readouterr().err


def test_eval_without_the_harness_names_the_extra(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-evaluation-harness were not installed
    assert main(["eval", "--model", "tiny-refusion", "--tasks", "tinybench_arith", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "lm-evaluation-harness" in err and "'.[eval]'" in err
