"""MATH answers as the paper's ``minerva_math`` scored them.

The gold answer is the last ``\\boxed{...}`` of the solution; the model's answer is what follows
``Final Answer: The final answer is`` up to ``. I hope it is correct.``. Both are normalised with the
rules of Lewkowycz et al. (2022), appendix D (:func:`normalize_final_answer`) and compared by
:func:`is_equiv`: sympy's LaTeX parser (needs ``antlr4-python3-runtime==4.11``) and ``simplify`` of
the difference, 5 s at most. Strings sympy cannot parse (tuples, intervals, ...) are never equal, not
even to themselves.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger(__name__)

INVALID_ANSWER = "[invalidanswer]"
END_SEQUENCE = "I hope it is correct."
EQUIV_TIMEOUT_S = 5

# Appendix D of Lewkowycz et al. (2022): substitutions, then expressions removed, in this order.
SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
    "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"',
    "\\dots",
]


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` (braces balanced) or ``\\fbox{...}`` of ``text``; with a
    ``\\boxed `` (space form) anywhere, ``\\boxed `` and what follows the last one up to a ``$``."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The content of ``\\boxed{...}`` / ``\\boxed ...``."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a boxed answer: {boxed!r}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{"):-1]


def get_unnormalized_answer(text: str) -> str:
    """What follows ``Final Answer: The final answer is`` up to ``. I hope it is correct.`` (a text that
    ends right after ``<answer>. `` counts too), stripped; ``[invalidanswer]`` otherwise."""
    match = re.search(r"Final Answer: The final answer is(.*?). I hope it is correct.", text + END_SEQUENCE)
    return match.group(1).strip() if match else INVALID_ANSWER


def normalize_final_answer(final_answer: str) -> str:
    """Normalise a final answer (Lewkowycz et al. 2022, appendix D): the part after the last ``=``,
    substitutions and removed units/words, the content of ``$...$`` / ``\\text{}`` / ``\\textbf{}`` /
    ``\\overline{}`` / ``\\boxed{}``, shorthand ``\\frac``/``\\sqrt`` braced, ``$`` dropped, and
    thousands commas removed from a number."""
    answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)  # \fracab -> \frac{a}{b}
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)  # \sqrta -> \sqrt{a}
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # 100,000 -> 100000
        answer = answer.replace(",", "")
    return answer


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """SIGALRM after ``seconds`` raises TimeoutError (main thread only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise TimeoutError("Timeout")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _latex_parser():
    try:
        import sympy
        from sympy.parsing.latex import parse_latex
        from sympy.parsing.latex.errors import LaTeXParsingError
    except ImportError as e:  # pragma: no cover - sympy ships with torch
        raise ImportError("minerva_math's exact_match needs sympy (pip install sympy)") from e
    return sympy, parse_latex, LaTeXParsingError


def is_equiv(x1: str, x2: str) -> bool:
    """Whether two normalised LaTeX answers are equal: both parse with sympy's LaTeX parser and the
    difference simplifies to 0 within 5 s. Raises ImportError when the parser's ANTLR runtime
    (``antlr4-python3-runtime==4.11``) is missing."""
    sympy, parse_latex, LaTeXParsingError = _latex_parser()
    try:
        with _time_limit(EQUIV_TIMEOUT_S):
            try:
                a, b = parse_latex(x1), parse_latex(x2)
            except (LaTeXParsingError, sympy.SympifyError, TypeError):
                log.debug("could not parse %r or %r", x1, x2)
                return False
            try:
                difference = a - b
            except TypeError:
                log.debug("could not subtract %r and %r", x1, x2)
                return False
            try:
                return bool(sympy.simplify(difference) == 0)
            except ValueError:
                log.debug("could not simplify the difference of %r and %r", x1, x2)
                return False
    except TimeoutError:
        log.debug("timed out comparing %r and %r", x1, x2)
        return False
    except ImportError as e:
        raise ImportError("minerva_math's exact_match needs sympy's LaTeX parser: "
                          "pip install 'antlr4-python3-runtime==4.11.*'") from e
    except Exception as e:  # noqa: BLE001 - any other failure of the comparison counts as unequal
        log.debug("failed comparing %r and %r: %s", x1, x2, e)
        return False


def math_verify_equal(solution: str, response: str) -> bool:
    """``math_verify``'s verdict: the response's parsed answer against the solution's."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError("minerva_math's math_verify metric needs math-verify: pip install math-verify") from e
    return bool(verify(gold=parse(solution), target=parse(response)))
