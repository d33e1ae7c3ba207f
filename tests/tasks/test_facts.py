import pytest

from refusion.tasks import TASKS
from refusion.tasks.facts import ATTRIBUTES, LETTERS, FactsTask, build_knowledge_base


@pytest.fixture(scope="module")
def task():
    return TASKS["facts"]


def test_knowledge_base_is_fixed_and_well_formed(task):
    facts, pools = build_knowledge_base()
    assert (facts, pools) == (task.facts, task.pools)
    assert len(facts) * len(ATTRIBUTES) == 240
    capitals = [f["capital"] for f in facts.values()]
    assert len(set(capitals)) == len(capitals)
    assert not set(capitals) & set(facts)
    for attrs in facts.values():
        assert all(attrs[a.name] in pools[a.name] for a in ATTRIBUTES)


def test_questions_have_four_options_and_one_gold_letter(task):
    for example in task.examples("test") + task.examples("validation"):
        question, *options = example.query.split("\n")
        assert [o[:5] for o in options] == [f"- ({letter})" for letter in LETTERS]  # marker, then value
        values = [o[6:] for o in options]
        gold = task.facts[example.meta["country"]][example.meta["attribute"]]
        assert len(set(values)) == 4 and values[LETTERS.index(example.answer)] == gold
        assert all(v in task.pools[example.meta["attribute"]] for v in values)
        assert example.response.endswith(f"The answer is {example.answer}.")
        walk = ", ".join(f"({letter}) {v} {'yes' if v == gold else 'no'}" for letter, v in zip(LETTERS, values))
        assert f" {gold}. {walk}. The answer" in example.response  # the fact, then every option judged in order
        assert task.extract(example.response) == example.answer


def test_train_teaches_every_fact_and_eval_queries_are_new(task):
    train = task.examples("train")
    assert len(train) == 7200 and train[:100] == FactsTask().examples("train", 100)
    statements = {e.response for e in train if "(A)" not in e.query}
    for country in task.facts:
        for attribute in ATTRIBUTES:
            assert task.statement(country, attribute) in statements
    questions = [e for e in train if "(A)" in e.query]
    assert len({(e.meta["country"], e.meta["attribute"]) for e in questions}) == 240
    queries = {e.query for e in train}
    for split in ("validation", "test"):
        evaluated = [e.query for e in task.examples(split)]
        assert len(set(evaluated)) == 200 and not queries & set(evaluated)
    assert not {e.query for e in task.examples("test")} & {e.query for e in task.examples("validation")}


@pytest.mark.parametrize("completion, letter", [
    ("The capital of X is Y. The answer is B.", "B"),
    ("the answer is: (c)", None),
    ("Answer is (C)", "C"),
    ("B", "B"),
    (" D. Kelu", "D"),
    ("(A)", "A"),
    ("I would pick C here", "C"),
    ("A fox is the animal of X.", None),
    ("The capital of X is Y. (A) Kelu no, (B) Y yes, (C) Sabe no", "B"),  # a walk cut short: its one "yes"
    ("(A) Kelu no, (B) Y no, (C) Sabe no, (D) Tovi", None),  # no "yes": no answer, not the last marker
    ("(A) Kelu yes, (B) Y yes", None),
    ("(A) Kelu no, (B) Y yes. The answer is D.", "D"),  # the stated answer wins
    ("", None),
])
def test_extract(task, completion, letter):
    assert task.extract(completion) == letter


def test_score(task):
    example = task.examples("test", 1)[0]
    wrong = next(letter for letter in LETTERS if letter != example.answer)
    assert task.score(example, example.response)
    assert task.score(example, example.answer)
    assert not task.score(example, f"The answer is {wrong}.")
