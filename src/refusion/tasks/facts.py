"""``facts``: multiple-choice questions about a synthetic knowledge base.

The knowledge base (fixed seed) describes 48 invented countries by 5 attributes each, 240 facts:
a capital (an invented city, unique per country), a language (invented), a national animal, a flag
colour and a famous dish (each from a small shared pool). A question asks for one attribute in one of
three phrasings and lists four options, the right value and three distractors from the same pool. The
answer states the fact, then walks the options in order, judging each, then names the letter::

    Which city is the capital of Dravonia?
    - (A) Kelu
    - (B) Marotin
    - (C) Sabe
    - (D) Tovira

    The capital of Dravonia is Marotin. (A) Kelu no, (B) Marotin yes, (C) Sabe no, (D) Tovira no. The answer is B.

Why this shape: each step of the walk is easy for a small model: the next marker is the next letter,
the option after it is copied from the query line that starts with the same marker (one-token marker,
then the value), the yes/no judgment is made on the value's own tokens, and the letter is the marker
before the one "yes". The markers `` (A)``..`` (D)`` are whole tokens of the tinybench tokenizer, so
"- (A) Kelu" in the query and ", (A) Kelu" in the answer share the marker and the value tokens.

The train split repeats, in shuffled rounds, every fact as a statement ("What is the capital of
Dravonia?" -> "The capital of Dravonia is Marotin."; its ``answer`` is the value) and as two
multiple-choice questions, so a model can learn the knowledge base. Validation and test are other
question instances (phrasing, distractors and option order) about the same facts; their queries
never occur in train.
The answer is the letter; extraction reads "answer is X", else the walk's one option judged "yes",
else (an answer without a walk) a bare leading letter or a lone letter.

Response length in tokens of the shipped tokenizer (``python -m refusion.tasks``, all splits):
min 7, p10 8, median 29, p90 39, max 48 (queries: median 23, max 38; the statements of train are the
short ones). ``max_new_tokens`` = 64: the longest gold response plus ~30%, rounded up to a multiple of 32.

``facts_hard`` (:class:`FactsHardTask`), the harder level: the question follows a true statement about
another country and the same attribute. In half of the questions that statement's value is one of the
three distractors (a misleading context), in the other half it is not among the options.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from refusion.tasks.base import Example, Task, split_of

LETTERS = "ABCD"
OPTION_MARKERS = tuple(f" ({letter})" for letter in LETTERS)  # whole tokens in the tinybench tokenizer
ANIMALS = ("owl", "fox", "wolf", "bear", "eagle", "deer", "horse", "lion", "swan", "crow", "hare", "lynx")
COLORS = ("red", "blue", "green", "gold", "black", "white", "purple", "orange", "silver", "brown")
DISHES = ("rice", "bread", "soup", "cheese", "fish", "beans", "noodles", "plums", "honey", "pie", "corn", "figs")


@dataclass(frozen=True)
class Attribute:
    name: str
    statement: str  # "{e}" the country, "{v}" the value
    questions: tuple[str, str, str]


ATTRIBUTES = (
    Attribute("capital", "The capital of {e} is {v}.",
              ("What is the capital of {e}?", "Which city is the capital of {e}?", "Name the capital of {e}.")),
    Attribute("language", "The language of {e} is {v}.",
              ("What is the language of {e}?", "Which language do people in {e} speak?",
               "What language is spoken in {e}?")),
    Attribute("animal", "The animal of {e} is the {v}.",
              ("What is the national animal of {e}?", "Which animal stands for {e}?",
               "What animal is the symbol of {e}?")),
    Attribute("color", "The flag of {e} is {v}.",
              ("What color is the flag of {e}?", "Which color is the flag of {e}?",
               "The flag of {e} has which color?")),
    Attribute("dish", "The dish of {e} is {v}.",
              ("What is the famous dish of {e}?", "Which dish is {e} known for?", "What food is {e} famous for?")),
)
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_ANSWER_IS = re.compile(r"(?i:answer is)\W*([A-D])\b")
_WALK_STEP = re.compile(r"\(([A-D])\)[^,.()]*?\b(yes|no)\b")  # "(B) Marotin yes"
_LEADING = re.compile(r"^\W*(?!A[ \t]+[a-z])([A-D])\b")  # "A fox ..." is an article, not an answer
_LONE = re.compile(r"\b(?!A[ \t]+[a-z])([A-D])\b")


def _words(
    rng: random.Random, n: int, syllables: tuple[int, int], suffixes: tuple[str, ...], taken: set[str]
) -> list[str]:
    """``n`` new capitalised pseudo-words (not in ``taken``, which they join)."""
    out: list[str] = []
    while len(out) < n:
        stem = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(*syllables)))
        word = (stem + rng.choice(suffixes)).capitalize()
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def build_knowledge_base(
    n_countries: int = 48, seed: int = 1234
) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, ...]]]:
    """``(facts, pools)``: country -> attribute -> value, and attribute -> all its possible values."""
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = _words(rng, n_countries, (2, 2), ("land", "ia", "stan", "mark", "ora"), taken)
    pools = {
        "capital": tuple(_words(rng, n_countries, (2, 3), ("",), taken)),
        "language": tuple(_words(rng, 12, (1, 2), ("ish", "ic", "ese"), taken)),
        "animal": ANIMALS,
        "color": COLORS,
        "dish": DISHES,
    }
    facts = {
        country: {a.name: pools[a.name][i] if a.name == "capital" else rng.choice(pools[a.name]) for a in ATTRIBUTES}
        for i, country in enumerate(countries)
    }
    return facts, pools


class FactsTask(Task):
    name = "facts"
    max_new_tokens = 64
    sizes = {"train": 7200, "validation": 200, "test": 200}
    chance_accuracy = 1 / len(LETTERS)

    def __init__(self) -> None:
        self.facts, self.pools = build_knowledge_base()
        self.pairs = [(country, a) for country in self.facts for a in ATTRIBUTES]

    def statement(self, country: str, attribute: Attribute) -> str:
        return attribute.statement.format(e=country, v=self.facts[country][attribute.name])

    def question(self, rng: random.Random, country: str, attribute: Attribute) -> Example:
        """A multiple-choice question about one fact, with random phrasing, distractors and order."""
        value = self.facts[country][attribute.name]
        options = rng.sample([v for v in self.pools[attribute.name] if v != value], 3) + [value]
        rng.shuffle(options)
        answer = LETTERS[options.index(value)]
        query = "\n".join([rng.choice(attribute.questions).format(e=country)]
                          + [f"-{marker} {option}" for marker, option in zip(OPTION_MARKERS, options)])
        walk = ",".join(f"{marker} {option} {'yes' if option == value else 'no'}"
                        for marker, option in zip(OPTION_MARKERS, options))
        response = f"{self.statement(country, attribute)}{walk}. The answer is {answer}."
        return Example(self.name, query, response, answer, {"country": country, "attribute": attribute.name})

    def sample(self, rng: random.Random) -> Example:
        return self.question(rng, *rng.choice(self.pairs))

    def _generate(self, split: str, n: int) -> list[Example]:
        if split != "train":
            return super()._generate(split, n)
        rng = random.Random(f"{self.name}:{split}")
        out: list[Example] = []
        while len(out) < n:  # one round: every fact as a statement and as two questions, shuffled
            round_ = [Example(self.name, a.questions[0].format(e=c), self.statement(c, a), self.facts[c][a.name],
                              {"country": c, "attribute": a.name}) for c, a in self.pairs]
            for country, attribute in self.pairs * 2:
                example = self.question(rng, country, attribute)
                while split_of(self.name, example.query) != split:
                    example = self.question(rng, country, attribute)
                round_.append(example)
            rng.shuffle(round_)
            out += round_
        return out[:n]

    def extract(self, completion: str) -> str | None:
        match = _ANSWER_IS.search(completion)
        if match:
            return match.group(1)
        walk = _WALK_STEP.findall(completion)
        if walk:  # a walk without its last sentence: the one option judged "yes", if there is exactly one
            yes = [letter for letter, judged in walk if judged == "yes"]
            return yes[0] if len(yes) == 1 else None
        match = _LEADING.search(completion)
        if match:
            return match.group(1)
        lone = _LONE.findall(completion)
        return lone[-1] if lone else None

    def score(self, example: Example, completion: str) -> bool:
        return self.extract(completion) == example.answer


class FactsHardTask(FactsTask):
    """The harder level: a statement about another country (same attribute) before each question."""

    name = "facts_hard"
    split_name = "facts"

    def question(self, rng: random.Random, country: str, attribute: Attribute) -> Example:
        example = super().question(rng, country, attribute)
        options = {line.split(") ", 1)[1] for line in example.query.split("\n")[1:]}
        value = self.facts[country][attribute.name]
        misleading = rng.random() < 0.5
        kinds = {kind: [c for c in self.facts if self.facts[c][attribute.name] != value
                        and (self.facts[c][attribute.name] in options) == kind] for kind in (True, False)}
        if not kinds[misleading]:  # no country holds a value of that kind: the other kind
            misleading = not misleading
        context = self.statement(rng.choice(kinds[misleading]), attribute)
        return Example(self.name, f"{context}\n{example.query}", example.response, example.answer,
                       {**example.meta, "misleading": misleading})

    def _generate(self, split: str, n: int) -> list[Example]:
        return Task._generate(self, split, n)  # every split holds questions (no statement rounds)
