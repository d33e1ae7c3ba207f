"""The harder level of each tinybench task: its own generator, splits that never meet the base task's
train split, gold responses that score, and the harder structure it promises."""

import re

import pytest

from refusion.tasks import HARD_TASKS, TASKS, get_task, split_of

LINE = re.compile(r"^(\w+) (?:buys|has) [^,]+, so \1 has (\d+) ([*+-]) (\d+) = (\d+) (\w+)\.$")


@pytest.mark.parametrize("name", sorted(HARD_TASKS))
def test_eval_splits_are_disjoint_and_never_in_the_base_tasks_train_split(name):
    task = get_task(name)
    base = task.split_name
    assert base in TASKS and name == f"{base}_hard" and name not in TASKS  # never in the training mixture
    val, test = ({e.query for e in task.examples(s)} for s in ("validation", "test"))
    assert len(val) == len(test) == 200 and not val & test
    assert all(split_of(base, q) == "test" for q in test) and all(split_of(base, q) == "validation" for q in val)
    assert not test & {e.query for e in TASKS[base].examples("train", 5000)}
    assert task.examples("test", 20) == type(task)().examples("test")[:20]


@pytest.mark.parametrize("name", sorted(HARD_TASKS))
def test_gold_responses_score_and_differ_from_the_base_level(name):
    task, base = get_task(name), TASKS[get_task(name).split_name]
    examples = task.examples("test", 40)
    if name != "code_hard":  # code is scored in the sandbox: one is enough here
        assert all(task.score(e, e.response) for e in examples)
    assert task.score(examples[0], examples[0].response)
    assert not {e.query for e in examples} & {e.query for e in base.examples("test")}


def test_arith_hard_has_four_parts_and_larger_steps():
    steps = []
    for example in get_task("arith_hard").examples("test"):
        *lines, _total, _final = example.response.split("\n")
        assert len(lines) == 4
        for line in lines:
            _, a, op, b, c, _ = LINE.match(line).groups()
            if op != "*":
                steps.append(int(b))
    assert max(steps) == 11 and min(steps) == 2 and sum(b > 9 for b in steps) > 60


def test_code_hard_maps_three_or_four_times():
    counts = [len(re.findall(r"^ +y = ", e.response, re.M)) for e in get_task("code_hard").examples("test")
              if "len(result)" not in e.response]  # a count maps nothing
    assert set(counts) == {3, 4}


def test_facts_hard_puts_a_true_statement_about_another_country_first():
    task = get_task("facts_hard")
    kinds = []
    for example in task.examples("test"):
        context, question, *options = example.query.split("\n")
        values = [o.split(") ", 1)[1] for o in options]
        country = example.meta["country"]
        assert country not in context and country in question and len(values) == 4
        assert any(context == task.statement(c, a) for c in task.facts for a in _attributes(example))
        kinds.append(example.meta["misleading"])
        assert any(v in context for v in values) == example.meta["misleading"]
    assert 70 < sum(kinds) < 130


def _attributes(example):
    from refusion.tasks.facts import ATTRIBUTES

    return [a for a in ATTRIBUTES if a.name == example.meta["attribute"]]
