"""The ablation and bench table printed to the terminal."""


def test_printed_tables_keep_brackets_in_labels(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per row
    from refusion.experiments.runner import print_table

    row = {"task": "arith", "run": "refusion [fused]", "n": 2, "accuracy": 0.5, "tokens_per_second": 10.0,
           "tpf": 2.0, "nfe_mean": 3.0, "latency_s_mean": 0.1, "speedup": 1.5}
    print_table([row], title="ablation [kv]")
    out = capsys.readouterr().out
    assert "refusion [fused]" in out and "ablation [kv]" in out  # not read as rich markup
