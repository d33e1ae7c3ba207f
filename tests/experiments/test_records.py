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
