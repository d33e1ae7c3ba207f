"""The command line: generate (text and --json), plugins, errors that name the field."""

import json

import pytest

from refusion.cli import main
from refusion.models.loading import save_pretrained


@pytest.fixture
def model_dir(tmp_path, backbone):
    return str(save_pretrained(backbone.model, backbone.tokenizer, tmp_path / "tiny"))


def test_generate_json(model_dir, capsys):
    rc = main(["generate", "--model", model_dir, "--decoder", "refusion", "--prompt", "12+3=", "--json",
               "--set", "gen_length=16", "--set", "slot_size=4", "--set", "selector.slot_threshold=0.0"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"}
    assert {"generated_tokens", "nfe", "tpf", "tokens_per_second", "wall_s"} <= set(out["stats"])
    assert out["stats"]["generated_tokens"] == len(out["token_ids"]) <= 16


def test_generate_stream_prints_the_commits_then_the_result(model_dir, capsys):
    args = ["generate", "--model", model_dir, "--decoder", "refusion", "--prompt", "12+3=", "--json",
            "--set", "gen_length=16", "--set", "slot_size=4", "--set", "selector.slot_threshold=0.0"]
    assert main(args + ["--stream"]) == 0
    *commits, last = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(args) == 0
    assert last == {**json.loads(capsys.readouterr().out), "stats": last["stats"]}  # the same decode
    assert [t for c in commits for t in c["token_ids"]] == last["token_ids"]
    assert [p for c in commits for p in c["positions"]] == list(range(commits[0]["positions"][0], len(last["token_ids"]) + commits[0]["positions"][0]))
    assert "".join(c["text"] for c in commits) == last["text"]
    assert main([a for a in args if a != "--json"] + ["--stream"]) == 0  # text mode: the completion, then the table
    assert capsys.readouterr().out.startswith(last["text"])


def test_generate_table_and_config_file(model_dir, tmp_path, capsys):
    cfg = tmp_path / "ar.toml"
    cfg.write_text('decoder = "ar"\ngen_length = 8\n')
    assert main(["generate", "--model", model_dir, "--config", str(cfg), "--prompt", "ab"]) == 0
    out = capsys.readouterr().out
    assert "tokens_per_second" in out and "nfe" in out


def test_generate_prints_the_completion_verbatim(model_dir, capsys, monkeypatch):
    from refusion.core.interfaces import Decoder

    real_generate = Decoder.generate

    def first_line_printed_for(text: str) -> str:
        def generate(self, prompt_ids, **kw):
            result = real_generate(self, prompt_ids, **kw)
            result.text = text
            return result

        monkeypatch.setattr(Decoder, "generate", generate)
        assert main(["generate", "--model", model_dir, "--decoder", "ar", "--set", "gen_length=4", "--prompt", "ab"]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert first_line_printed_for("[bold]x[/bold] [1, 2]") == "[bold]x[/bold] [1, 2]"  # not read as rich markup
    assert first_line_printed_for("") == "(empty completion: the model ended at once)"


def test_empty_prompt_is_refused_before_loading_a_model(capsys):
    rc = main(["generate", "--model", "no/such/folder", "--decoder", "ar", "--prompt", ""])
    assert rc == 2
    assert "--prompt: empty prompt" in capsys.readouterr().err


def test_bad_config_names_field(model_dir, capsys):
    rc = main(["generate", "--model", model_dir, "--decoder", "refusion", "--prompt", "x",
               "--set", "verifier.token_threshold=2"])
    assert rc == 2
    assert "verifier.token_threshold" in capsys.readouterr().err


def test_plugins_lists_kinds_and_origins(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    kinds = {(r["kind"], r["name"]) for r in rows}
    assert ("decoder", "refusion") in kinds and ("cache", "kv_recompute") in kinds and ("scorer", "margin") in kinds
    assert all(r["origin"].startswith("builtin ") for r in rows)


def test_batch_size_flags_are_wired(capsys):
    from refusion.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "--batch-size", "4"]).batch_size == 4
    assert parser.parse_args(["bench"]).batch_size is None  # the config's batch_size, else 1
    assert parser.parse_args(["ablate", "x.yaml", "--batch-size", "8"]).batch_size == 8
    a = parser.parse_args(["batch-bench", "--batch-sizes", "1,8"])
    assert a.batch_sizes == "1,8" and a.time_forwards is None
    assert parser.parse_args(["eval", "--model", "m", "--tasks", "t", "--batch-size", "8"]).batch_size == 8


def test_eval_batch_size_zero_is_refused_before_loading(capsys):
    pytest.importorskip("lm_eval")
    assert main(["eval", "--model", "no-such-model", "--tasks", "x", "--batch-size", "0"]) == 2
    assert "batch_size: must be a positive integer or 'auto', got 0" in capsys.readouterr().err


def test_train_grow_layers_saves_the_deeper_model_and_refuses_a_shallower_one(tmp_path, capsys):
    from refusion.models.loading import load_pretrained

    run = ["train", "--objective", "mdm", "--init", "scratch", "--size", "micro", "--steps", "1", "--batch-size",
           "2", "--limit", "8", "--threads", "1", "--no-progress"]
    assert main(run + ["--out", str(tmp_path / "deep"), "--grow-layers", "3"]) == 0
    assert load_pretrained(tmp_path / "deep")[0].config.num_hidden_layers == 3
    manifest = json.loads((tmp_path / "deep" / "manifest.json").read_text())
    assert manifest["command"] == "train" and manifest["inputs"]["grow_layers"] == 3
    assert manifest["inputs"]["threads"] == manifest["torch_threads"] == 1
    with pytest.raises(SystemExit) as exit_info:
        main(run + ["--out", str(tmp_path / "never"), "--grow-layers", "2"])
    assert exit_info.value.code == 2
    assert "--grow-layers: num_layers must exceed the model's 2 layers" in capsys.readouterr().err


COMMANDS = {  # every command that decodes or trains, with its required arguments
    "generate": ["--model", "m", "--prompt", "p"], "bench": [], "batch-bench": [], "profile": [],
    "ablate": ["x.yaml"], "results": [], "trace": [], "train": ["--out", "o"], "eval": ["--model", "m", "--tasks", "t"],
    "serve": ["--model", "m"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_that_decodes_or_trains_takes_threads(command, capsys):
    from refusion.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command, *COMMANDS[command], "--threads", "auto"]).threads == "auto"
    assert parser.parse_args([command, *COMMANDS[command]]).threads is None  # the command's default
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    assert "--threads N|auto" in capsys.readouterr().out


def test_generate_decodes_in_one_thread_unless_told(model_dir, capsys):
    """torch's default of one thread per core spin-waits beside another busy process; decoding commands
    default to one thread."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["generate", "--model", model_dir, "--decoder", "ar", "--set", "gen_length=2", "--prompt", "a"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["generate", "--model", model_dir, "--decoder", "ar", "--set", "gen_length=2", "--prompt", "a",
                     "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
        assert main(["generate", "--model", model_dir, "--decoder", "ar", "--prompt", "a", "--threads", "two"]) == 2
        assert "--threads: expected a number of threads or 'auto', got 'two'" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_auto_threads_are_the_free_physical_cores(monkeypatch):
    from refusion.core import threads

    monkeypatch.setattr(threads, "physical_cores", lambda: 4)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    assert threads.resolve_threads("auto") == 3
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (7.0, 0.0, 0.0))
    assert threads.resolve_threads("auto") == 1
    assert threads.resolve_threads(None) == 1 and threads.resolve_threads(None, default=2) == 2
    assert threads.resolve_threads(None, default=None) is None


def test_a_table_wider_than_the_terminal_says_where_every_column_is(monkeypatch, capsys):
    """`refusion plugins` (and the bench and ablation summaries) on a narrow terminal: rich cuts cells, and a
    note on stderr says so and how to see them whole; on a wide one, no note."""
    from refusion.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plugins"]) == 0
    err = capsys.readouterr().err
    assert "terminal has 80" in err and "refusion plugins --json" in err, err
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plugins"]) == 0
    assert "note:" not in capsys.readouterr().err
