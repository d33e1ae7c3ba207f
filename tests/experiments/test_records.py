import json

import pytest

from refusion.experiments.records import RecordWriter, done_keys, load_records


def test_torn_last_line_is_dropped_with_warning(tmp_path):
    p = tmp_path / "r.jsonl"
    with RecordWriter(p) as w:
        w.write({"task": "a", "idx": 0})
        w.write({"task": "a", "idx": 1})
    with open(p, "a") as fh:
        fh.write('{"task": "a", "idx": 2, "comp')  # killed mid-write
    with pytest.warns(UserWarning, match="torn last line"):
        recs = load_records(p)
    assert [r["idx"] for r in recs] == [0, 1]
    assert done_keys(recs, ("task", "idx")) == {("a", 0), ("a", 1)}
    with RecordWriter(p) as w:  # appending after the repair gives a valid file
        w.write({"task": "a", "idx": 2})
    assert [json.loads(x)["idx"] for x in p.read_text().splitlines()] == [0, 1, 2]


def test_corrupt_middle_line_is_an_error(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_records(p)


FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def test_records_written_before_the_typed_records_load_and_write_back_the_same_line():
    """main_samples.jsonl was written by the runner before SampleRecord (every bench row, speculative counts
    included, and batch-bench's batched, forward-timed records): each line reads into a SampleRecord and
    writes back byte for byte, and its shared calculations are the ones the old readers made."""
    from refusion.experiments.records import SampleRecord

    lines = (FIXTURES / "main_samples.jsonl").read_text().splitlines()
    assert len(lines) > 20
    kinds = set()
    for line in lines:
        data = json.loads(line)
        rec = SampleRecord.from_dict(data)
        assert json.dumps(rec.to_dict(), ensure_ascii=False) == line
        share = data["wall_s"] if data.get("batch_wall_s") is None else data["batch_wall_s"] / data["batch_samples"]
        assert rec.decode_share_s() == share and rec.key == (data["idx"], data.get("seed"))
        kinds.add(("batched" if rec.batch_wall_s is not None else "single", bool(rec.extra),
                   rec.forward_share_s() is not None))
    assert ("batched", False, True) in kinds and ("single", True, False) in kinds  # batches, timed; drafter counts
    with pytest.raises(ValueError, match="needs nfe"):
        SampleRecord.from_dict({"run": "a", "generated_tokens": 1, "wall_s": 0.1})


def test_summaries_of_old_records_are_the_ones_the_old_code_computed():
    """The bench's rows (paired intervals against ar included) and batch-bench's rows over main_samples.jsonl
    equal those the code before the typed records computed from the same file (main_summary.json)."""
    from refusion.experiments.batching import batching_rows
    from refusion.experiments.runner import Run, summarize

    recs = [json.loads(line) for line in (FIXTURES / "main_samples.jsonl").read_text().splitlines()]
    want = json.loads((FIXTURES / "main_summary.json").read_text())

    def runs_of(rs):
        out = {}
        for r in rs:
            params = {"batch_size": r.get("batch_size", 1)} if "@" in r["run"] else {}
            out.setdefault(r["run"], Run(label=r["run"], model=r["model"], configs={"arith": {"decoder": r["decoder"]}},
                                         params=params, batch_size=r.get("batch_size", 1)))
        return list(out.values())

    bench = [r for r in recs if "@" not in r["run"]]
    batch = [r for r in recs if "@" in r["run"]]
    assert json.loads(json.dumps(summarize(bench, runs_of(bench), baseline="ar"))) == want["bench"]
    assert json.loads(json.dumps(batching_rows(batch, runs_of(batch)))) == want["batch"]
