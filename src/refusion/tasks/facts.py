"""``facts``: multiple-choice questions about a synthetic knowledge base.

The knowledge base (fixed seed) describes 48 invented countries by 5 attributes each, 240 facts:
a capital (an invented city, unique per country), a language (invented), a national animal, a flag
colour and a famous dish (each from a small shared pool). A question asks for one attribute in one of
three phrasings and lists four options, the right value and three distractors from the same pool::

    Which city is the capital of Dravonia?
    - Kelu (A)
    - Marotin (B)
    - Sabe (C)
    - Tovira (D)

    The capital of Dravonia is Marotin (B). The answer is B.

Each option is written value first, letter after, after "- " so that the value is the same tokens as
in the answer sentence (a word at the start of a line and the same word after a space are different
BPE tokens): naming the value and then its letter is a copy of what follows the value in the query.
(The first version listed ``B. Marotin``; a 3.4M model then stated the right fact and picked a wrong
letter, since the letter precedes the value it has to find.) The marker `` (B)`` is one token of the
tinybench tokenizer: with `` (`` and ``B`` as two tokens, the v1 models (3.4M) named the right value
20/20 times and answered 4/20, since the token after every value was the same `` (`` and the
letter had to be found two tokens back. With the marker as one token the v2 models (3.4M) still name
the right value and then a wrong letter (docs/training.md): the copy is not learned at that size and
budget, and the task is due for a redesign.

The train split repeats, in shuffled rounds, every fact as a statement ("What is the capital of
Dravonia?" -> "The capital of Dravonia is Marotin."; its ``answer`` is the value) and as two
multiple-choice questions, so a model can learn the knowledge base. Validation and test are other
question instances (phrasing, distractors and option order) about the same facts; their queries
never occur in train.
The answer is the letter; extraction reads "answer is X", a bare leading letter, or a lone letter.

Response length in tokens of the shipped tokenizer (``python -m refusion.tasks``, all splits):
min 8, p10 8, median 15, p90 17, max 19 (queries: median 24, max 41). ``max_new_tokens`` = 32:
the longest gold response plus ~30%, rounded up to a multiple of 32.
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
    max_new_tokens = 32
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
                          + [f"- {option}{marker}" for marker, option in zip(OPTION_MARKERS, options)])
        statement = self.statement(country, attribute)
        value_at = statement.rindex(value) + len(value)  # the letter follows the value, as in the options
        response = f"{statement[:value_at]} ({answer}){statement[value_at:]} The answer is {answer}."
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
        for pattern in (_ANSWER_IS, _LEADING):
            match = pattern.search(completion)
            if match:
                return match.group(1)
        lone = _LONE.findall(completion)
        return lone[-1] if lone else None

    def score(self, example: Example, completion: str) -> bool:
        return self.extract(completion) == example.answer
