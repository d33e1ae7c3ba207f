"""Splitting an evaluation's records over worker shards and joining them back."""

import json
import sys

import pytest

from refusion.core.config import ConfigError
from refusion.experiments.sharding import join_records, parse_shard, run_shards, shard_folder, split_records


def rec(run, idx, task="facts"):
    return {"run": run, "task": task, "idx": idx, "correct": True}


def write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_deals_by_index_and_join_restores_one_sorted_file(tmp_path):
    """Records of a joined file and of a killed run's shards (one key in both) are dealt again to 3 shards
    by idx mod 3, each key once; joining sorts them and removes the shards."""
    write(tmp_path / "samples.jsonl", [rec("ar", 0), rec("ar", 1)])
    write(shard_folder(tmp_path, 1) / "samples.jsonl", [rec("ar", 1), rec("ar", 3), rec("x", 3)])
    assert split_records(tmp_path, 3) == 4
    assert not (tmp_path / "samples.jsonl").exists()
    assert [[(r["run"], r["idx"]) for r in read(shard_folder(tmp_path, k) / "samples.jsonl")] for k in range(3)] == \
        [[("ar", 0), ("ar", 3), ("x", 3)], [("ar", 1)], []]
    joined = join_records(tmp_path, lambda r: (r["idx"], r["run"]))
    assert [(r["run"], r["idx"]) for r in joined] == [("ar", 0), ("ar", 1), ("ar", 3), ("x", 3)]
    assert read(tmp_path / "samples.jsonl") == joined and not (tmp_path / "shards").exists()


@pytest.mark.parametrize("bad", ["2", "2/2", "-1/2", "a/b", "1/0"])
def test_shard_must_be_k_of_n(bad):
    with pytest.raises(ConfigError, match="--shard: expected K/N"):
        parse_shard(bad)
    assert parse_shard("1/2") == (1, 2)


def test_a_failed_worker_is_named_with_its_log_and_the_others_finish(tmp_path):
    def command(k, folder):
        code = f"import pathlib; pathlib.Path({str(folder)!r}, 'samples.jsonl').write_text('{{}}\\n'); raise SystemExit({k})"
        return [sys.executable, "-c", code]

    split_records(tmp_path, 2)
    with pytest.raises(RuntimeError, match=r"1 of 2 workers failed \(logs: .*shards/1/run.log\)"):
        run_shards(tmp_path, 2, command, total=2)
    assert (shard_folder(tmp_path, 0) / "samples.jsonl").read_text() == "{}\n"
