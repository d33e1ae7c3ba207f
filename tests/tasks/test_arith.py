import json
import re

import pytest

from refusion.tasks import SPLITS, TASKS, corpus, export_json, get_task, split_of
from refusion.tasks.arith import ArithTask, total_line

LINE = re.compile(r"^(\w+) (?:buys|has) [^,]+, so \1 has (\d+) ([*+-]) (\d+) = (\d+) (\w+)\.$")


@pytest.fixture(scope="module")
def task():
    return TASKS["arith"]


def test_splits_are_deterministic_prefix_closed_and_disjoint(task):
    assert [len(task.examples(s)) for s in SPLITS] == [20000, 200, 200]
    fresh = ArithTask()  # no shared cache
    assert fresh.examples("test") == task.examples("test")
    assert task.examples("train", 50) == task.examples("train")[:50]
    train = {e.query for e in task.examples("train")}
    for split in ("validation", "test"):
        queries = [e.query for e in task.examples(split)]
        assert len(set(queries)) == len(queries)
        assert not train & set(queries)
        assert all(split_of("arith", q) == split for q in queries)
    assert not {e.query for e in task.examples("validation")} & {e.query for e in task.examples("test")}


def test_responses_compute_correctly(task):
    for example in task.examples("validation") + task.examples("train", 500):
        *lines, total, final = example.response.split("\n")
        assert 3 <= len(lines) <= 4
        values = []
        for line in lines:
            name, a, op, b, c, obj = LINE.match(line).groups()
            a, b, c = int(a), int(b), int(c)
            assert c == {"*": a * b, "+": a + b, "-": a - b}[op]
            assert (b <= 9) and (op != "*" or a <= 5)  # one single-digit operand per part
            restated = line.split(", so ")[0]
            assert f"{restated}." in example.query and f"How many {obj}" in example.query
            values.append(c)
        assert total == total_line(values)
        assert final == f"#### {sum(values)}" and example.answer == str(sum(values))
        assert task.extract(example.response) == example.answer


def test_total_line_reduces_two_terms_at_a_time():
    assert total_line([36, 39, 25]) == "Total: 36 + 39 + 25 = 75 + 25 = 100."


def test_extract_and_score(task):
    example = task.examples("test", 1)[0]
    assert task.score(example, example.response)
    assert task.score(example, f"blah\n####  {example.answer}\nmore text 12")
    assert not task.score(example, f"The answer is {example.answer}.")
    assert not task.score(example, f"#### {int(example.answer) + 1}")
    assert task.extract("#### 007") == "7" and task.extract("#### -3") == "-3" and task.extract("") is None


def test_registry_export_and_corpus(tmp_path):
    assert set(TASKS) == {"arith", "code", "facts"}
    assert get_task("facts") is TASKS["facts"]
    with pytest.raises(ValueError, match="arith, code, facts"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="train"):
        get_task("arith").examples("dev")
    path = tmp_path / "data.json"
    assert export_json(path, ["arith", "facts"], "test", 5) == 10
    records = json.loads(path.read_text())
    assert records[0] == {"query": TASKS["arith"].examples("test", 1)[0].query,
                          "response": TASKS["arith"].examples("test", 1)[0].response}
    assert all(set(r) == {"query", "response"} for r in records)
    assert len(corpus("test")) == 600
    json.dumps([e.meta for e in corpus("test")])  # meta is JSON-serialisable
