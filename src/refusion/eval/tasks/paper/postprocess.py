"""Text post-processing of the paper's evaluation, as pure functions (no lm-eval import).

The ReFusion reference model wrapper treated every generated text the same way before the harness's
filters saw it: cut at the request's stop strings, drop the tokenizer's special tokens, and, when the
text holds a fenced ```` ```python ```` block, keep only that block's body. The stop strings are cut by
the model (:func:`refusion.eval.lm_eval_adapter.cut_at_stop`); the other two steps are
:func:`reference_postprocess`, the first filter step of every ``refusion_*`` paper task.

HumanEval's programs are built by :func:`humaneval_program`: the code of the answer's fence (or the
whole answer), appended to the problem's prompt, then reduced by :func:`sanitize` to the imports and
the definitions the entry point depends on.
"""

from __future__ import annotations

import ast
import re
from typing import Iterable

# Chat-control tokens of the Qwen / ReFusion tokenizers: <|im_start|>, <|im_end|>, <|endoftext|>,
# <|mask|>, <|beginoftext|>, <|fim_...|>, ... (``<think>`` / ``</think>`` are ordinary tokens there).
SPECIAL_TOKEN = re.compile(r"<\|[^<>|\s]+\|>")
PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.DOTALL)
MAX_SANITIZE_LINES = 100  # only the first 100 lines are searched for the longest valid code


def strip_special_tokens(text: str) -> str:
    """``text`` without special-token strings (what decoding with ``skip_special_tokens=True`` drops)."""
    return SPECIAL_TOKEN.sub("", text)


def extract_python_block(text: str) -> str:
    """The body of the first ```` ```python\\n ... \\n``` ```` block (newlines required on both
    sides of the body); ``text`` unchanged when there is none."""
    match = PYTHON_BLOCK.search(text)
    return match.group(1) if match else text


def reference_postprocess(text: str) -> str:
    """Special tokens dropped, then the first ```` ```python ```` block's body if there is one."""
    return extract_python_block(strip_special_tokens(text))


# --------------------------------------------------------------------------------------- HumanEval
def humaneval_code(response: str) -> str:
    """The code in a completion that started after an opening ```` ```python\\n ````: the text after the
    first ```` ```python\\n ```` it contains (all of it when none), up to the next ```` ``` ````."""
    return response.split("```python\n", 1)[-1].split("```")[0]


def humaneval_program(prompt: str, response: str, entry_point: str) -> str:
    """The program that is tested: the problem's prompt, a newline, the completion's code, sanitized."""
    return sanitize(prompt + "\n" + humaneval_code(response), entry_point)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, MemoryError, ValueError, RecursionError):  # ValueError: NUL bytes (Python < 3.12)
        return False
    return True


def longest_valid_code(text: str) -> str:
    """The run of consecutive lines (among the first 100) that parses as Python and has the most
    non-blank lines; the first such run when several tie; ``""`` when no line parses."""
    lines = text.splitlines()[:MAX_SANITIZE_LINES]
    filled = [1 if line.strip() else 0 for line in lines]
    left = [0] * (len(lines) + 1)  # left[i]: non-blank lines from i to the end
    for i in range(len(lines) - 1, -1, -1):
        left[i] = left[i + 1] + filled[i]
    best, best_code = 0, ""
    for i in range(len(lines)):
        if left[i] <= best:  # no run starting here can beat the best
            break
        count = 0
        for j in range(i, len(lines)):
            count += filled[j]
            if count > best:
                code = "\n".join(lines[i:j + 1])
                if _parses(code):
                    best, best_code = count, code
    return best_code


def _names_used(node: ast.AST) -> set[str]:
    """Names a definition refers to: every ``Name`` id and ``Attribute`` attr below it (an attribute's
    own object expression is not searched)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, ast.Name):
                found.add(child.id)
            elif isinstance(child, ast.Attribute):
                found.add(child.attr)
            else:
                stack.append(child)
    return found


def _reachable(start: str, uses: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop(0)
        if name not in seen:
            seen.add(name)
            todo.extend(uses.get(name, set()) - seen)
    return seen


def _normalise_source(text: str) -> str:
    text = text.replace("\t", "    ").replace("\r\n", "\n").replace("\r", "\n")
    return text.strip() + "\n"


def sanitize(text: str, entry_point: str | None = None) -> str:
    """Keep the longest parseable part of ``text`` (tabs as 4 spaces, line ends normalised) and, of its
    top-level statements, the imports, the classes, the functions that contain a ``return``, and the
    assignments to a plain name; with ``entry_point``, only the definitions it reaches through the names
    it uses (transitively). A later definition of a name replaces an earlier one in the earlier one's
    place. The result is re-rendered by ``ast.unparse``: imports first, then definitions."""
    tree = ast.parse(longest_valid_code(_normalise_source(text)))
    imports: list[ast.stmt] = []
    definitions: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, ast.ClassDef):
            definitions[node.name] = node
        elif isinstance(node, ast.FunctionDef):
            if any(isinstance(n, ast.Return) for n in ast.walk(node)):
                definitions[node.name] = node
        elif isinstance(node, ast.Assign) and node.targets and isinstance(node.targets[0], ast.Name):
            definitions[node.targets[0].id] = node
    keep: Iterable[str] = definitions
    if entry_point:
        reached = _reachable(entry_point, {name: _names_used(node) for name, node in definitions.items()})
        keep = [name for name in definitions if name in reached]
    return "\n".join([ast.unparse(node) for node in imports] + [ast.unparse(definitions[name]) for name in keep])
