import json

import pytest

from refusion.tasks import TASKS, split_of
from refusion.tasks.code import CodeTask


@pytest.fixture(scope="module")
def task():
    return TASKS["code"]


def test_splits_are_deterministic_prefix_closed_and_disjoint(task):
    assert task.sizes == {"train": 20000, "validation": 200, "test": 200}
    assert CodeTask().examples("test", 50) == task.examples("test")[:50]
    train = {e.query for e in task.examples("train", 5000)}  # the full split takes seconds; split_of covers the rest
    assert len(train) == 5000 and all(split_of("code", q) == "train" for q in train)
    for split in ("validation", "test"):
        queries = {e.query for e in task.examples(split)}
        assert len(queries) == 200 and all(split_of("code", q) == split for q in queries)
        assert not train & queries


def test_gold_functions_pass_their_hidden_tests(task):
    for example in task.examples("validation") + task.examples("test") + task.examples("train", 1000):
        assert 3 <= len(example.meta["tests"]) <= 5
        assert example.meta["entry"] == example.answer
        assert example.response.startswith(f"def {example.answer}(")
        namespace: dict = {}
        exec(example.response, namespace)  # trusted: our own reference code
        for test in example.meta["tests"]:
            exec(test, namespace)
        json.dumps(example.meta)


def test_hidden_tests_discriminate(task):
    examples = task.examples("test")
    varied = sum(len({t.split(" == ")[1] for t in e.meta["tests"]}) > 1 for e in examples)
    assert varied >= 0.95 * len(examples)


def test_extract(task):
    source = "def f(xs):\n    if not xs:\n        return 0\n\n    return 1\n"
    assert task.extract(source) == source
    assert task.extract(f"Here it is:\n```python\n{source}```\nIt returns 1.\ndef g(): pass") == source
    indented = "".join("  " + line + "\n" for line in source.splitlines())
    assert task.extract("text\n" + indented + "after") == source
    assert task.extract("no code here") is None


def test_score_runs_the_completion_in_the_sandbox(task):
    example = task.examples("test", 1)[0]
    assert task.score(example, example.response)
    assert task.score(example, f"```python\n{example.response}\n```\nDone.")
    body_lines = example.response.split("\n")
    assert not task.score(example, "\n".join(body_lines[:1] + ["    return None"]))
    assert not task.score(example, example.response.replace(f"def {example.answer}(", "def other("))
    assert not task.score(example, "def broken(:\n    pass")
    assert not task.score(example, "I cannot write that.")
    assert not task.score(example, f"def {example.answer}(*args):\n    raise SystemExit(0)")
