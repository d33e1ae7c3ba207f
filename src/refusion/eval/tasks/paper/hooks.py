"""The functions the ``refusion_*`` paper task YAMLs name with ``!function``: filters, document
processing, prompts, results and the code-execution metrics.

Filters (``function: custom``, ``filter_fn: ...``) take the responses of each document and return them
processed: :func:`postprocess_filter` (special tokens dropped, ```` ```python ```` body kept),
:func:`lstrip_filter`, :func:`gpqa_flexible_extract`, :func:`humaneval_build_programs`.

``pass_at_1`` (mbpp) and ``pass_at_k`` (humaneval, reported as ``pass@1``) run each program followed by
its tests in :func:`refusion.tasks.sandbox.run_sandboxed` (3 s, as the ``code_eval`` metric): a program
passes when it runs to the end without an exception (``exit()`` counts as a failure); a top-level
``if __name__ == "__main__":`` block does not run. Like ``code_eval`` they refuse to run unless
``HF_ALLOW_CODE_EVAL=1`` (``refusion eval --confirm-run-unsafe-code`` sets it).
"""

from __future__ import annotations

import os
import random
import re
import sys
import unicodedata
from functools import cache, partial
from math import comb
from typing import Any, Sequence

from refusion.eval.tasks.paper.math_answer import (
    get_unnormalized_answer,
    is_equiv,
    last_boxed_only_string,
    math_verify_equal,
    normalize_final_answer,
    remove_boxed,
)
from refusion.eval.tasks.paper.postprocess import humaneval_program, reference_postprocess

CODE_TIMEOUT_S = 3.0
CODE_MEMORY_MB = 2048

Responses = Sequence[Sequence[str]]  # per document: its responses (one per repeat)


# ------------------------------------------------------------------------------------------ filters
def postprocess_filter(resps: Responses, docs: Sequence[dict]) -> list[list[str]]:
    """Every response through :func:`~refusion.eval.tasks.paper.postprocess.reference_postprocess`."""
    return [[reference_postprocess(r) if isinstance(r, str) else r for r in rs] for rs in resps]


def lstrip_filter(resps: Responses, docs: Sequence[dict]) -> list[list[str]]:
    """Leading whitespace removed (trailing whitespace kept)."""
    return [[r.lstrip() for r in rs] for rs in resps]


@cache
def _punctuation_table() -> dict[int, None]:
    return dict.fromkeys(i for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith("P"))


def _normalise_choice_text(text: str) -> str:
    return text.lower().translate(_punctuation_table())


def _last_match(regex: re.Pattern, text: str, to_label: dict[str, str] | None = None) -> str:
    found = regex.findall(text)
    if not found:
        return ""
    match = found[-1]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "")
    match = match.strip()
    return (to_label or {}).get(match, match) if match else match


def multi_choice_extract(response: str, choices: Sequence[str], fallback: str = "[invalid]") -> str:
    """The answer label ``(X)`` of a response to a lettered multiple-choice question:

    1. the last ``(A)``..``(Z)`` in the response;
    2. else the last occurrence of a choice's text (both lower-cased, punctuation removed; the choices
       tried in their order as regex alternatives) mapped to its label;
    3. else the last ``:`` followed by a bare letter of the choices, as ``(X)``;
    4. else ``[invalid]``.
    """
    match = _last_match(re.compile(r"(\([A-Z]\))"), response)
    if match:
        return match
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    texts = [_normalise_choice_text(c.strip()) for c in choices]
    by_text = {t: f"({letter})" for t, letter in zip(texts, letters)}
    match = _last_match(re.compile("|".join(re.escape(t) for t in texts)), _normalise_choice_text(response), by_text)
    if match:
        return match
    match = _last_match(re.compile(rf":[\s]*({'|'.join(letters)})"), response, {x: f"({x})" for x in letters})
    return match or fallback


def gpqa_flexible_extract(resps: Responses, docs: Sequence[dict]) -> list[list[str]]:
    """GPQA's ``flexible-extract``: :func:`multi_choice_extract` against the document's shuffled choices."""
    return [[multi_choice_extract(r, doc["choices"]) for r in rs] for rs, doc in zip(resps, docs)]


def humaneval_build_programs(resps: Responses, docs: Sequence[dict]) -> list[list[str]]:
    """HumanEval: each response as the sanitized program of
    :func:`~refusion.eval.tasks.paper.postprocess.humaneval_program`."""
    return [[humaneval_program(doc["prompt"], r, doc["entry_point"]) for r in rs] for rs, doc in zip(resps, docs)]


# ----------------------------------------------------------------------------- code execution
def _require_code_eval() -> None:
    if os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
        raise ValueError("this metric runs model-written code: set HF_ALLOW_CODE_EVAL=1 to allow it "
                         "(refusion eval --confirm-run-unsafe-code does)")


def _checker(program: str) -> str:
    """A script running ``program`` in a fresh namespace (as ``exec`` does: ``__name__`` is not
    ``"__main__"``) that exits with status 1 on any exception, ``SystemExit`` included."""
    return ("import sys\n"
            f"_program = {program!r}\n"
            "try:\n"
            "    exec(compile(_program, '<program>', 'exec'), {})\n"
            "except BaseException:\n"
            "    import traceback\n"
            "    traceback.print_exc()\n"
            "    sys.stdout.flush()\n"
            "    sys.stderr.flush()\n"
            "    import os\n"
            "    os._exit(1)\n")


def program_passes(program: str, tests: str, timeout_s: float = CODE_TIMEOUT_S) -> bool:
    """Whether ``program + "\\n" + tests`` runs to its end within ``timeout_s`` in the sandbox."""
    from refusion.tasks.sandbox import run_sandboxed

    return run_sandboxed(_checker(program + "\n" + tests), timeout_s=timeout_s, memory_mb=CODE_MEMORY_MB).ok


def estimate_pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples of which ``correct`` pass."""
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def pass_at_k(references: Sequence[str], predictions: Sequence[Sequence[str]], k: int | Sequence[int] = (1,)) -> dict:
    """``{"pass@<k>": mean over problems}``: ``predictions[i]`` are the candidate programs of the
    problem whose test code is ``references[i]``."""
    _require_code_eval()
    ks = [k] if isinstance(k, int) else list(k)
    passed = [sum(program_passes(p, ref) for p in cands) for ref, cands in zip(references, predictions, strict=True)]
    sizes = [len(cands) for cands in predictions]
    return {f"pass@{kk}": sum(estimate_pass_at_k(n, c, kk) for n, c in zip(sizes, passed)) / len(passed)
            for kk in ks if all(n >= kk for n in sizes)}


def pass_at_1(references: str | Sequence[str], predictions: Sequence[str] | Sequence[Sequence[str]]) -> float:
    """mbpp's ``pass_at_1``: one program (or a list of candidates) per problem."""
    if isinstance(references, str):
        references = [references]
    if isinstance(predictions[0], str):
        predictions = [[p] for p in predictions]  # type: ignore[misc]
    return pass_at_k(references, predictions, k=[1])["pass@1"]


# ----------------------------------------------------------------------------------------- GPQA
def _gpqa_clean(text: str | None) -> str:
    if text is None:
        return " "
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def gpqa_process_docs(dataset):
    """The four answers cleaned (``[title]`` as ``. ``, ``[...]`` removed, double spaces halved) and
    shuffled with Python's global ``random`` (seeded by the harness's ``--seed``); ``choice1``..``choice4``,
    ``choices`` and the gold label ``answer`` = ``(A)``..``(D)``."""
    def one(doc: dict) -> dict:
        choices = [_gpqa_clean(doc[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [_gpqa_clean(doc["Correct Answer"])]
        random.shuffle(choices)
        gold = choices.index(_gpqa_clean(doc["Correct Answer"]))
        return {**{f"choice{i + 1}": c for i, c in enumerate(choices)}, "choices": choices,
                "answer": f"({chr(65 + gold)})"}

    return dataset.map(one)


# ------------------------------------------------------------------------------------- MMLU-Pro
MMLU_PRO_LETTERS = "ABCDEFGHIJ"


def mmlu_pro_format(doc: dict, including_answer: bool = False) -> str:
    """``Question:\\n<question>\\nOptions:\\nA. <option>\\n...`` (options as given, at most ten), then
    ``Answer: Let's think step by step.`` or, with ``including_answer``, the worked answer and a blank line."""
    text = "Question:\n" + doc["question"] + "\nOptions:\n"
    for letter, option in zip(MMLU_PRO_LETTERS, doc["options"]):
        text += f"{letter}. {option}\n"
    if including_answer:
        return text + doc["cot_content"].replace("A: Let's think step by step.", "Answer: Let's think step by step.") + "\n\n"
    return text + "Answer: Let's think step by step."


mmlu_pro_doc_to_text = partial(mmlu_pro_format, including_answer=False)
mmlu_pro_fewshot_to_text = partial(mmlu_pro_format, including_answer=True)


def _mmlu_pro_subject(dataset, subject: str):
    return dataset.filter(lambda doc: doc["category"] == subject)


mmlu_pro_biology = partial(_mmlu_pro_subject, subject="biology")
mmlu_pro_business = partial(_mmlu_pro_subject, subject="business")
mmlu_pro_chemistry = partial(_mmlu_pro_subject, subject="chemistry")
mmlu_pro_computer_science = partial(_mmlu_pro_subject, subject="computer science")
mmlu_pro_economics = partial(_mmlu_pro_subject, subject="economics")
mmlu_pro_engineering = partial(_mmlu_pro_subject, subject="engineering")
mmlu_pro_health = partial(_mmlu_pro_subject, subject="health")
mmlu_pro_history = partial(_mmlu_pro_subject, subject="history")
mmlu_pro_law = partial(_mmlu_pro_subject, subject="law")
mmlu_pro_math = partial(_mmlu_pro_subject, subject="math")
mmlu_pro_other = partial(_mmlu_pro_subject, subject="other")
mmlu_pro_philosophy = partial(_mmlu_pro_subject, subject="philosophy")
mmlu_pro_physics = partial(_mmlu_pro_subject, subject="physics")
mmlu_pro_psychology = partial(_mmlu_pro_subject, subject="psychology")


# ---------------------------------------------------------------------------------- minerva_math
def minerva_doc_to_text(doc: dict) -> str:
    return "Problem:\n" + doc["problem"] + "\n\nSolution:"


def minerva_process_docs(dataset):
    """``answer``: the normalised content of the solution's last ``\\boxed{}``."""
    def one(doc: dict) -> dict:
        return {"problem": doc["problem"], "solution": doc["solution"],
                "answer": normalize_final_answer(remove_boxed(last_boxed_only_string(doc["solution"])))}

    return dataset.map(one)


def minerva_process_results(doc: dict, results: Sequence[str]) -> dict[str, int]:
    """``exact_match``: the normalised ``Final Answer: The final answer is ...`` equals the gold answer
    (:func:`~refusion.eval.tasks.paper.math_answer.is_equiv`); ``math_verify``: math-verify's verdict of
    the whole response against the solution."""
    response = results[0]
    answer = normalize_final_answer(get_unnormalized_answer(response))
    return {"exact_match": int(is_equiv(answer, doc["answer"])),
            "math_verify": int(math_verify_equal(doc["solution"], response))}


def minerva_fewshot_samples() -> list[dict[str, Any]]:
    """The four Minerva exemplars (used only with ``--num-fewshot`` > 0)."""
    return [
        {
            "problem": "Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.}",
            "solution": "The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so $x\\ge2$, and $5 - x \\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. Therefore, the domain of the expression is $\\boxed{[2,5)}$.\nFinal Answer: The final answer is $[2,5)$. I hope it is correct.",  # noqa: E501
            "few_shot": "1",
        },
        {
            "problem": "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} \\mathbf{B}).$",
            "solution": "We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = (2)(12) = \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct.",  # noqa: E501
            "few_shot": "1",
        },
        {
            "problem": "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many times must Terrell lift them in order to lift the same total weight?",  # noqa: E501
            "solution": "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of $2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n\\begin{align*}\n30n&=480\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}\nFinal Answer: The final answer is $16$. I hope it is correct.",  # noqa: E501
            "few_shot": "1",
        },
        {
            "problem": "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\n6y-9x &=b.\n\\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",  # noqa: E501
            "solution": "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$\nFinal Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct.",  # noqa: E501
            "few_shot": "1",
        },
    ]


# ----------------------------------------------------------------------------------------- mbpp
def mbpp_fewshot_samples() -> list[dict[str, Any]]:
    """mbpp's three prompt exemplars, tasks 2-4 (used only with ``--num-fewshot`` > 0)."""
    return [
        {
            "task_id": 2,
            "text": "Write a function to find the similar elements from the given two tuple lists.",
            "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) ",
            "test_list": [
                "assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
                "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)",
            ],
            "is_fewshot": True,
        },
        {
            "task_id": 3,
            "text": "Write a python function to identify non-prime numbers.",
            "code": "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n    for i in range(2,int(math.sqrt(n)) + 1):\r\n        if n % i == 0:\r\n            result = True\r\n    return result",  # noqa: E501
            "test_list": [
                "assert is_not_prime(2) == False",
                "assert is_not_prime(10) == True",
                "assert is_not_prime(35) == True",
            ],
            "is_fewshot": True,
        },
        {
            "task_id": 4,
            "text": "Write a function to find the largest integers from a given list of numbers using heap queue algorithm.",
            "code": "import heapq as hq\r\ndef heap_queue_largest(nums,n):\r\n  largest_nums = hq.nlargest(n, nums)\r\n  return largest_nums",  # noqa: E501
            "test_list": [
                "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65] ",
                "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],2)==[85, 75] ",
                "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],5)==[85, 75, 65, 58, 35]",
            ],
            "is_fewshot": True,
        },
    ]
