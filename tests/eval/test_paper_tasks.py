"""The paper's evaluation tasks (``refusion_*``, docs/paper_tasks.md): ``refusion eval`` finds them, the
harness renders the reference's prompts (checked verbatim, chat template applied as the paper ran them),
and a known-right and a known-wrong answer score 1 and 0 through each task's filters and metrics.

The documents are small hand-written files in each dataset's format (fixtures/paper_tasks); the task
YAMLs are loaded through lm-eval's TaskManager with only the dataset location overridden (local JSON
lines), so nothing is downloaded. The code tasks run their programs in the project's sandbox.
minerva_math's scoring needs sympy's LaTeX parser (antlr4-python3-runtime 4.11) and math-verify: those
checks are skipped without them.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import lm_eval.evaluator  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from refusion.eval.lm_eval_adapter import cut_at_stop  # noqa: E402
from refusion.eval.tasks.paper import PAPER_TASKS, TASKS_DIR, task_names  # noqa: E402
from refusion.eval.tasks.paper import hooks, math_answer, postprocess  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "paper_tasks"

# The reference's instruction strings (ML-GSAI/ReFusion @7c20c12), verbatim.
GSM8K_INSTRUCTION = ('Solve the following math problem. You need to think step-by-step, show your detailed reasoning, '
                     'and end with "The answer is [result]," where [result] is the answer you get.')
MBPP_INSTRUCTION = ("You are an expert Python programmer. Your task is to write a single Python function to solve the "
                    "problem described below, and here is your task: ")
MBPP_RULES = ("Directly after the '[BEGIN]' marker, you must write only the Python code for the function. Do not "
              "provide any explanations, comments, or introductory text. The function must include the 'def' line, "
              "its arguments, the function body, and a 'return' statement. Your code should pass these tests:")
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n```"
GPQA_DESCRIPTION = ("Answer the following multiple-choice question. Your response should be the letter of the correct "
                    "option, enclosed in parentheses ((A), (B), (C), or (D)).\n")
ARC_INSTRUCTION = ("Given the following question and four candidate answers (A, B, C and D), choose the best answer.")
ARC_ENDING = ('Your response should end with "The best answer is [the_answer_letter]" where the [the_answer_letter] '
              'is one of A, B, C or D.')
MMLU_PRO_DESCRIPTION = ("The following are multiple choice questions (with answers) about {}. Think step by step and "
                        'then finish your answer with "the answer is (X)" where X is the correct letter choice.\n')

DATA = {  # task or group -> split -> fixture file
    "refusion_gsm8k_cot": {"test": "gsm8k.jsonl"},
    "refusion_mbpp": {"test": "mbpp.jsonl"},
    "refusion_humaneval_instruct_noprefix": {"test": "humaneval.jsonl"},
    "refusion_gpqa_main_generative_n_shot": {"train": "gpqa_main.jsonl"},
    "refusion_arc_challenge_chat": {s: "arc_challenge.jsonl" for s in ("train", "validation", "test")},
    "refusion_mmlu_pro": {"test": "mmlu_pro_test.jsonl", "validation": "mmlu_pro_validation.jsonl"},
    "refusion_minerva_math": {"test": "minerva_math.jsonl", "train": "minerva_math.jsonl"},
}
METRICS = {  # task or group -> the result keys that must read 1 (right answers) or 0 (wrong ones)
    "refusion_gsm8k_cot": ["exact_match,strict-match", "exact_match,flexible-extract"],
    "refusion_mbpp": ["pass_at_1,none"],
    "refusion_humaneval_instruct_noprefix": ["pass@1,create_test"],
    "refusion_gpqa_main_generative_n_shot": ["exact_match,strict-match", "exact_match,flexible-extract"],
    "refusion_arc_challenge_chat": ["exact_match,remove_whitespace"],
    "refusion_mmlu_pro": ["exact_match,custom-extract"],
    "refusion_minerva_math": ["exact_match,none", "math_verify,none"],
}

HE_RIGHT = [
    "def has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold\n"
    "               for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n```\n\nEvery pair is compared.",
    "import math\n\n\ndef truncate_number(number: float) -> float:\n    return number - math.floor(number)\n\n\n"
    "print(truncate_number(3.5))\nassert truncate_number(3.5) == 0.5\n```",
]
HE_WRONG = ["def has_close_elements(numbers, threshold):\n    return False\n```",
            "def truncate_number(number: float) -> float:\n    return number\n```"]


def _gold_letter(doc: dict) -> str:
    return doc["answer"]


RESPONSES = {  # task -> (right, wrong): doc, doc_id -> the model's text (before the harness cuts it at `until`)
    "refusion_gsm8k_cot": (
        lambda doc, i: ["Janet sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = 18 dollars. The answer is 18.",
                        "It takes 2 / 2 = 1 bolt of white fiber, so 2 + 1 = 3 bolts. The answer is 3.",
                        "He spent 130,000 and sold for 200,000. The answer is 70,000.\nQ: what next?"][i],
        lambda doc, i: ["She makes 22 dollars. The answer is 22.", "The answer is 4.",
                        "The answer is 130,000."][i]),
    "refusion_mbpp": (
        lambda doc, i: ["Here is the function:\n```python\ndef remove_Occ(s, ch):\n    s = s.replace(ch, '', 1)\n"
                        "    i = s.rfind(ch)\n    return s if i < 0 else s[:i] + s[i + 1:]\n```<|im_end|>",
                        "def square_perimeter(a):\n    return 4 * a\n[DONE]\nMore text."][i],
        lambda doc, i: ["```python\ndef remove_Occ(s, ch):\n    return s\n```",
                        "def square_perimeter(a):\n    return a * a\n[DONE]"][i]),
    "refusion_humaneval_instruct_noprefix": (lambda doc, i: HE_RIGHT[i], lambda doc, i: HE_WRONG[i]),
    "refusion_gpqa_main_generative_n_shot": (
        lambda doc, i: f"Working it out, the option is {_gold_letter(doc)}. The answer is {_gold_letter(doc)}.",
        lambda doc, i: "The answer is {0}.".format(next(f"({x})" for x in "ABCD" if f"({x})" != _gold_letter(doc)))),
    "refusion_arc_challenge_chat": (
        lambda doc, i: [" A. Friction of dry skin", " D.", " A\n\nEvaporation."][i],
        lambda doc, i: [" B.", " A.", " C."][i]),
    "refusion_mmlu_pro": (
        lambda doc, i: {"biology": "Translation makes proteins, not DNA. The answer is (A).",
                        "computer science": "2^7 = 128 < 200 <= 256 = 2^8. The answer is (C)."}.get(
                            doc["category"], f"Step by step: the answer is ({doc['answer']})"),
        lambda doc, i: {"biology": "the answer is (B)", "computer science": "The answer is D."}.get(
            doc["category"], "the answer is ({})".format("B" if doc["answer"] == "A" else "A"))),
    "refusion_minerva_math": (
        lambda doc, i: ["The maximum is $\\sqrt{2}$.\nFinal Answer: The final answer is $\\sqrt{2}$. I hope it is correct.",
                        "The roots sum to 5.\nFinal Answer: The final answer is $5$. I hope it is correct.",
                        "Then $x=13$.\nFinal Answer: The final answer is $13$. I hope it is correct."][i],
        lambda doc, i: ["Final Answer: The final answer is $2$. I hope it is correct.",
                        "Final Answer: The final answer is $4$. I hope it is correct.",
                        "Final Answer: The final answer is $9$. I hope it is correct."][i]),
}


def chat(*turns: tuple[str, str], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n" if generation_prompt else text


class ScriptedLM(LM):
    """Answers each request with a scripted text, cut at the request's ``until`` as the refusion model does;
    a ChatML-like chat template (system / user / assistant turns)."""

    def __init__(self, right: bool) -> None:
        super().__init__()
        self.right = right
        self.requests: dict[tuple[str, int], tuple[str, dict]] = {}

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            self.requests[(req.task_name, req.doc_id)] = (context, kwargs)
            task = next(t for t in RESPONSES if req.task_name.startswith(t))
            out.append(cut_at_stop(RESPONSES[task][0 if self.right else 1](req.doc, req.doc_id), kwargs["until"]))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = chat(*((m["role"], m["content"]) for m in chat_history), generation_prompt=add_generation_prompt)
        return text if add_generation_prompt else text[: -len("<|im_end|>\n")]  # continue the final message

    def chat_template(self, chat_template: bool | str = False) -> str:
        return "chatml"

    @property
    def tokenizer_name(self) -> str:
        return "scripted"


def _override(directory: Path, base: Path) -> None:
    """``directory/<name>.yaml``: the shipped task (or group) ``base``, read from local JSON lines."""
    name = base.stem
    files = next(f for prefix, f in DATA.items() if name.startswith(prefix))
    spec = {"include": str(base), **({"group": name} if "\ngroup:" in base.read_text() else {"task": name}),
            "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(FIXTURES / f) for split, f in files.items()},
                               "cache_dir": str(directory / "hf_cache")}}
    (directory / f"{name}.yaml").write_text(json.dumps(spec), encoding="utf-8")  # JSON is YAML


def _has_math_scoring() -> bool:
    try:
        import math_verify  # noqa: F401
        from sympy.parsing.latex import parse_latex

        parse_latex("1")
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.fixture(scope="module")
def manager(tmp_path_factory) -> TaskManager:
    directory = tmp_path_factory.mktemp("paper_tasks")
    for base in TASKS_DIR.rglob("refusion_*.yaml"):  # every task and group, subtasks included
        _override(directory, base)
    return TaskManager(include_path=str(directory), include_defaults=False)


@pytest.fixture(scope="module")
def runs(manager, monkeypatch_module):
    """The harness on every task (minerva_math only with its scoring packages), once with right and once
    with wrong answers, chat template applied: ``{True: (results, lm), False: (results, lm)}``."""
    monkeypatch_module.setenv("HF_ALLOW_CODE_EVAL", "1")
    names = [n for n in DATA if n != "refusion_minerva_math" or _has_math_scoring()]
    out = {}
    for right in (True, False):
        random.seed(0)
        lm = ScriptedLM(right)
        res = lm_eval.evaluator.evaluate(lm, manager.load(names), apply_chat_template=True, log_samples=True,
                                         confirm_run_unsafe_code=True, bootstrap_iters=0)
        out[right] = (res, lm)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


# ------------------------------------------------------------------------------------ discovery
def test_the_seven_paper_tasks_are_indexed_from_the_package_folder():
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert set(task_names()) <= set(tm.all_tasks)
    assert set(PAPER_TASKS) == {"gsm8k_cot", "minerva_math", "mbpp", "humaneval_instruct_noprefix",
                                "gpqa_main_generative_n_shot", "arc_challenge_chat", "mmlu_pro"}
    assert set(tm.all_groups) == {"refusion_minerva_math", "refusion_mmlu_pro"}
    assert len([t for t in tm.all_subtasks if t.startswith("refusion_mmlu_pro_")]) == 14
    assert len([t for t in tm.all_subtasks if t.startswith("refusion_minerva_math_")]) == 7


def test_refusion_eval_finds_them_without_extra_flags(monkeypatch):
    """``refusion eval --tasks refusion_gsm8k_cot,refusion_mmlu_pro`` hands the harness a task manager that
    knows them (and, all being local, skips indexing the harness's built-in tasks)."""
    import lm_eval as harness

    import refusion.eval.cli as cli
    import refusion.eval.lm_eval_adapter as adapter

    seen = {}

    class StubLM:
        records, rank, world_size = [], 0, 1

        def __init__(self, **kwargs):
            pass

        def gather_object(self, obj, dst=0):
            return [obj]

        def close(self):
            pass

    def evaluate(**kwargs):
        seen.update(kwargs)
        return {"results": {}}

    monkeypatch.setattr(adapter, "RefusionLM", StubLM)
    monkeypatch.setattr(harness, "simple_evaluate", evaluate)
    monkeypatch.setattr(cli, "_report", lambda *a, **k: None)
    monkeypatch.setattr(cli, "_decoder_config", lambda args: {"decoder": "refusion"})
    parser = argparse.ArgumentParser()
    cli.add_eval_args(parser)
    args = parser.parse_args(["--model", "m", "--tasks", "refusion_gsm8k_cot,refusion_mmlu_pro", "--device", "cpu"])
    assert cli.run_eval(args) == 0
    tm = seen["task_manager"]
    assert seen["tasks"] == ["refusion_gsm8k_cot", "refusion_mmlu_pro"]
    assert {"refusion_gsm8k_cot", "refusion_mmlu_pro"} <= set(tm.all_tasks) and "gsm8k_cot" not in tm.all_tasks


# -------------------------------------------------------------------------------- rendered prompts
def _context(runs, task: str, doc_id: int = 0) -> tuple[str, dict]:
    return runs[True][1].requests[(task, doc_id)]


def _doc(name: str, i: int = 0) -> dict:
    return json.loads((FIXTURES / DATA[name][next(iter(DATA[name]))]).read_text().splitlines()[i])


def test_gsm8k_cot_prompt_is_the_references_instruction_with_a_literal_backslash_n(runs):
    context, kwargs = _context(runs, "refusion_gsm8k_cot")
    question = _doc("refusion_gsm8k_cot")["question"]
    assert context == chat(("user", GSM8K_INSTRUCTION + "\\nQ: " + question + "\nA:"))
    assert kwargs["until"] == ["Q:", "</s>", "<|im_end|>"]


def test_mbpp_prompt_and_stop(runs):
    context, kwargs = _context(runs, "refusion_mbpp")
    doc = _doc("refusion_mbpp")
    user = MBPP_INSTRUCTION + doc["text"] + "\n\n" + MBPP_RULES + "\n\n" + "\n".join(doc["test_list"]) + "\n[BEGIN]\n"
    assert context == chat(("user", user))
    assert kwargs["until"] == ["[DONE]"]


def test_humaneval_prompt_continues_an_open_python_fence(runs):
    context, kwargs = _context(runs, "refusion_humaneval_instruct_noprefix")
    prompt = _doc("refusion_humaneval_instruct_noprefix")["prompt"]
    assert context == chat(("user", HUMANEVAL_INSTRUCTION + prompt + "```"), ("assistant", "```python\n"),
                           generation_prompt=False)[: -len("<|im_end|>\n")]
    assert kwargs["until"] == ["\nassert", "\n# Test"]


def test_gpqa_description_is_the_system_turn_and_choices_are_shuffled_labels(runs):
    context, kwargs = _context(runs, "refusion_gpqa_main_generative_n_shot", 1)
    assert context.startswith(chat(("system", GPQA_DESCRIPTION), generation_prompt=False))
    assert "<|im_start|>user\nQuestion: Which reagent converts a primary alcohol" in context
    assert "\nChoices:\n(A) " in context and "\n(D) " in context and context.endswith("\nAnswer:<|im_end|>\n<|im_start|>assistant\n")
    # the cleaned answers: " [title]" -> ". ", "[...]" removed, stripped
    assert "pyridinium chlorochromate (PCC). in dichloromethane" in context and "chromic acid \n" in context
    assert kwargs["until"] == ["</s>", "Question:", "<|im_end|>"]


def test_arc_prompt_literal_backslash_n_and_answer_prefix(runs):
    context, kwargs = _context(runs, "refusion_arc_challenge_chat", 1)
    doc = _doc("refusion_arc_challenge_chat", 1)
    t = doc["choices"]["text"]
    user = (ARC_INSTRUCTION + "\\nQuestion: " + doc["question"].strip() + f"\\nA. {t[0]}\\nB. {t[1]}\\nC. {t[2]}"
            f"\\nD. {t[3]}\\n" + ARC_ENDING)
    assert context == chat(("user", user), ("assistant", "The best answer is"), generation_prompt=False)[: -len("<|im_end|>\n")]
    three, _ = _context(runs, "refusion_arc_challenge_chat", 2)
    assert "\\nC. precipitation\\nYour response" in three  # no D line for three choices
    assert kwargs["until"] == ["\n\n", "."] and kwargs["max_gen_toks"] == 100


def test_mmlu_pro_prompt_per_subject_keeps_option_text_as_given(runs):
    context, kwargs = _context(runs, "refusion_mmlu_pro_computer_science", 0)
    doc = _doc("refusion_mmlu_pro", 1)
    options = "".join(f"{letter}. {o}\n" for letter, o in zip("ABCDEFGHIJ", doc["options"]))
    user = "Question:\n" + doc["question"] + "\nOptions:\n" + options + "Answer: Let's think step by step."
    assert context == chat(("system", MMLU_PRO_DESCRIPTION.format("computer science")), ("user", user))
    assert "\nC. 8 \n" in context  # the option's trailing space is kept
    biology, _ = _context(runs, "refusion_mmlu_pro_biology", 0)
    assert MMLU_PRO_DESCRIPTION.format("biology") in biology
    assert kwargs["until"] == ["Question:"]


def test_minerva_math_prompt(manager):
    task = manager.load(["refusion_minerva_math_algebra"])["tasks"]["refusion_minerva_math_algebra"]
    doc = task.test_docs()[1]
    assert doc["answer"] == "5"  # the normalised last \boxed{} of the solution
    assert task.fewshot_context(doc, 0) == "Problem:\n" + doc["problem"] + "\n\nSolution:"
    assert task.config.generation_kwargs["until"] == ["Problem:"]


def test_few_shot_exemplars_when_asked_for(manager):
    """Zero-shot by default (as the paper ran); --num-fewshot N renders the reference's exemplars."""
    load = lambda name: manager.load([name])["tasks"][name]  # noqa: E731
    gsm8k, mbpp, mmlu = load("refusion_gsm8k_cot"), load("refusion_mbpp"), load("refusion_mmlu_pro_biology")
    assert gsm8k.config.num_fewshot == mbpp.config.num_fewshot == mmlu.config.num_fewshot == 0
    text = gsm8k.fewshot_context(gsm8k.test_docs()[0], 2)
    assert text.startswith(GSM8K_INSTRUCTION + "\\nQ: There are 15 trees in the grove.")
    assert "The answer is 6." in text
    text = mbpp.fewshot_context(mbpp.test_docs()[0], 1)
    assert "def similar_elements(test_tup1, test_tup2):" in text and "\n[DONE]" in text
    text = mmlu.fewshot_context(mmlu.test_docs()[0], 1)
    assert "Answer: Let's think step by step. Peptidoglycan" in text


# ---------------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("task", [t for t in METRICS if t != "refusion_minerva_math"])
def test_right_answers_score_1_and_wrong_answers_0(runs, task):
    for right in (True, False):
        results = runs[right][0]["results"][task]
        for key in METRICS[task]:
            assert results[key] == (1.0 if right else 0.0), (task, key, right)


def test_every_document_scored_in_both_runs(runs):
    for right in (True, False):
        samples = runs[right][0]["samples"]
        docs = {task: {s["doc_id"] for s in logged} for task, logged in samples.items()}
        assert docs["refusion_gsm8k_cot"] == docs["refusion_arc_challenge_chat"] == {0, 1, 2}
        assert docs["refusion_mbpp"] == docs["refusion_humaneval_instruct_noprefix"] == {0, 1}
        assert {len(v) for k, v in docs.items() if k.startswith("refusion_mmlu_pro_")} == {1}  # one per subject
        assert len([k for k in samples if k.startswith("refusion_mmlu_pro_")]) == 14


def test_code_answers_are_extracted_and_sanitized(runs):
    (mbpp0, mbpp1) = runs[True][0]["samples"]["refusion_mbpp"]
    assert mbpp0["filtered_resps"][0].startswith("def remove_Occ(s, ch):") and "```" not in mbpp0["filtered_resps"][0]
    assert mbpp1["filtered_resps"][0] == "def square_perimeter(a):\n    return 4 * a\n"  # cut at [DONE]
    _, he = runs[True][0]["samples"]["refusion_humaneval_instruct_noprefix"]
    program = he["filtered_resps"][0][0]
    assert program == "import math\ndef truncate_number(number: float) -> float:\n    return number - math.floor(number)"


def test_minerva_math_right_1_wrong_0():
    if not _has_math_scoring():
        pytest.skip("minerva_math's scoring needs antlr4-python3-runtime==4.11 and math-verify")
    doc = {"solution": "so $x=\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}"}
    assert hooks.minerva_process_results(doc, ["Final Answer: The final answer is $0.5$. I hope it is correct."]) == \
        {"exact_match": 1, "math_verify": 1}
    assert hooks.minerva_process_results(doc, ["Final Answer: The final answer is $2$. I hope it is correct."]) == \
        {"exact_match": 0, "math_verify": 0}


def test_minerva_math_group_through_the_harness(runs):
    if not _has_math_scoring():
        pytest.skip("minerva_math's scoring needs antlr4-python3-runtime==4.11 and math-verify")
    for right in (True, False):
        results = runs[right][0]["results"]["refusion_minerva_math"]
        for key in METRICS["refusion_minerva_math"]:
            assert results[key] == (1.0 if right else 0.0), (key, right)


# ------------------------------------------------------------------------------ post-processing
def test_reference_postprocess_drops_special_tokens_then_keeps_the_python_block():
    assert postprocess.strip_special_tokens("x<|im_end|><|endoftext|> y<|mask|>") == "x y"
    assert postprocess.strip_special_tokens("<think>a</think>") == "<think>a</think>"  # not special in Qwen3
    text = "Sure:\n```python\ndef f():\n    return 1\n```\nand\n```python\nx = 2\n```"
    assert postprocess.reference_postprocess(text) == "def f():\n    return 1"
    assert postprocess.reference_postprocess("```python\nx = 1```") == "```python\nx = 1```"  # needs \n before the fence
    assert postprocess.reference_postprocess("```py\nx = 1\n```") == "```py\nx = 1\n```"
    assert postprocess.reference_postprocess("The answer is 5.<|im_end|>") == "The answer is 5."


def test_humaneval_code_is_the_text_inside_the_fence():
    assert postprocess.humaneval_code("    return 1\n```\nExplanation") == "    return 1\n"
    assert postprocess.humaneval_code("Intro\n```python\ncode\n```") == "code\n"
    assert postprocess.humaneval_code("no fence at all") == "no fence at all"


def test_sanitize_keeps_imports_and_what_the_entry_point_reaches():
    text = ("Here is my answer.\nimport math\nfrom typing import List\n\nLIMIT = 3\nUNUSED = 4\n\n"
            "def helper(x):\n\treturn math.sqrt(x) + LIMIT\n\ndef noop():\n    pass\n\n"
            "def other():\n    return 0\n\nclass Box:\n    pass\n\n"
            "def solve(xs: List[int]) -> float:\n    return helper(xs[0])\n\nprint(solve([4]))\n")
    assert postprocess.sanitize(text, "solve") == (
        "import math\nfrom typing import List\nLIMIT = 3\n"
        "def helper(x):\n    return math.sqrt(x) + LIMIT\n"
        "def solve(xs: List[int]) -> float:\n    return helper(xs[0])")
    everything = postprocess.sanitize(text)
    assert "def other()" in everything and "class Box" in everything and "UNUSED = 4" in everything
    assert "def noop" not in everything and "print(" not in everything  # no return / not a definition


def test_sanitize_takes_the_longest_parseable_run_and_a_later_definition_wins():
    text = "def f(:\n    broken\ndef g():\n    return 1\ndef g():\n    return 2\n```\ntrailing prose"
    assert postprocess.sanitize(text, "g") == "def g():\n    return 2"
    assert postprocess.sanitize("", "g") == ""
    assert postprocess.longest_valid_code("x = 1\n(\ny = 2\nz = 3") == "y = 2\nz = 3"


def test_humaneval_program_joins_prompt_and_completion():
    doc = _doc("refusion_humaneval_instruct_noprefix", 1)
    program = postprocess.humaneval_program(doc["prompt"], "    return number % 1.0\n```", doc["entry_point"])
    assert program.startswith("def truncate_number(number: float) -> float:\n    \"\"\" Given a positive floating")
    assert program.endswith("return number % 1.0")


def test_multi_choice_extract_follows_the_references_fallbacks():
    choices = ["1/5", "2/5", "4/5", "1/2"]
    assert hooks.multi_choice_extract("(A) or rather (C)", choices) == "(C)"  # the last (X)
    assert hooks.multi_choice_extract("I pick 2/5!", choices) == "(B)"  # a choice's text
    assert hooks.multi_choice_extract("Answer: D", ["x1", "x2", "x3", "x4"]) == "(D)"  # ": <letter>"
    assert hooks.multi_choice_extract("no idea", ["x1", "x2", "x3", "x4"]) == "[invalid]"
    # choices are regex alternatives in their order: a choice that is a prefix of a later one wins
    assert hooks.multi_choice_extract("it is guilty of romance", ["Guilty", "Guilty of Romance", "x", "y"]) == "(A)"


def test_lstrip_filter_keeps_trailing_whitespace():
    assert hooks.lstrip_filter([[" D\n", "  A"]], [{}]) == [["D\n", "A"]]


def test_gpqa_docs_are_cleaned_and_shuffled_with_the_global_random_state():
    datasets = pytest.importorskip("datasets")
    docs = datasets.Dataset.from_list([json.loads(x) for x in (FIXTURES / "gpqa_main.jsonl").read_text().splitlines()])
    random.seed(3)
    first = hooks.gpqa_process_docs(docs).to_list()
    random.seed(3)
    again = hooks.gpqa_process_docs(docs).to_list()
    assert [d["choices"] for d in first] == [d["choices"] for d in again]
    for doc in first:
        gold = "ABCD".index(doc["answer"][1])
        assert doc["choices"][gold] == hooks._gpqa_clean(doc["Correct Answer"])
        assert [doc[f"choice{i}"] for i in range(1, 5)] == doc["choices"]
    assert sorted(first[1]["choices"]) == sorted(["pyridinium chlorochromate (PCC). in dichloromethane",
                                                  "potassium permanganate, heat", "chromic acid ", "sodium borohydride"])


def test_minerva_answer_normalisation():
    assert math_answer.last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\boxed{\\frac{1}{2}}"
    assert math_answer.last_boxed_only_string("\\boxed 5$ more") == "\\boxed 5"
    assert math_answer.last_boxed_only_string("none") is None
    assert math_answer.remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    get = math_answer.get_unnormalized_answer
    assert get("so Final Answer: The final answer is $5$. I hope it is correct.") == "$5$"
    assert get("Final Answer: The final answer is 7. ") == "7"  # cut off after the sentence's ". "
    assert get("Final Answer: The final answer is 7") == "[invalidanswer]"
    assert get("The answer is 7.") == "[invalidanswer]"
    norm = math_answer.normalize_final_answer
    assert norm("$x = \\frac12$") == "\\frac{1}{2}"
    assert norm("100,000") == "100000" and norm("0,1") == "01"  # the reference's rule: any commas of digits
    assert norm("\\text{5 dollars}") == "5" and norm("10^\\circ") == "10" and norm("\\sqrt2") == "\\sqrt{2}"


def test_minerva_equivalence_when_the_latex_parser_is_there():
    if not _has_math_scoring():
        pytest.skip("needs antlr4-python3-runtime==4.11")
    assert math_answer.is_equiv("\\frac{1}{2}", "0.5") and math_answer.is_equiv("x+1", "1+x")
    assert not math_answer.is_equiv("3", "4")
    assert not math_answer.is_equiv("(1,2)", "(1,2)")  # unparseable: never equal, as in the reference


# ------------------------------------------------------------------------------- code execution
def test_pass_at_1_runs_programs_against_their_tests(monkeypatch):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    tests = "assert add(2, 3) == 5"
    assert hooks.pass_at_1(tests, ["def add(a, b):\n    return a + b"]) == 1.0
    assert hooks.pass_at_1(tests, ["def add(a, b):\n    return a * b"]) == 0.0
    assert hooks.pass_at_1(tests, ["def add(a, b):\n    exit()\n"]) == 0.0  # exit() is a failure
    # as code_eval's exec: a __main__ block does not run
    assert hooks.pass_at_1(tests, ["def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    raise SystemExit(3)"]) == 1.0
    assert not hooks.program_passes("def add(a, b):\n    while True:\n        pass", tests, timeout_s=0.5)  # timeout
    assert hooks.pass_at_k([tests], [["def add(a, b):\n    return a + b", "def add(a, b):\n    return 0"]], k=[1, 2]) == \
        {"pass@1": 0.5, "pass@2": 1.0}
    assert hooks.estimate_pass_at_k(5, 0, 1) == 0.0 and hooks.estimate_pass_at_k(5, 5, 3) == 1.0


def test_code_metrics_refuse_without_hf_allow_code_eval(monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(ValueError, match="HF_ALLOW_CODE_EVAL=1"):
        hooks.pass_at_1("assert True", ["x = 1"])
