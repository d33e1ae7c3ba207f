"""Training data: the JSON format and tinybench, tokenised to ``(prompt_ids, response_ids)`` pairs.

Format (the same at training and decoding time): the prompt is ``query + "\\n"``, the response is the
response text followed by the EOS id. Query and response are encoded SEPARATELY, without special
tokens added by the tokenizer, so that BPE never merges across the boundary. Decoders must build
prompts with :func:`encode_prompt` to match.

``data`` is either ``"tinybench"`` (the generated tasks of :mod:`refusion.tasks`, splits ``train`` /
``validation`` / ``test``), ``"tinybench:TASK=K,..."`` (the same, with each named task's train examples
repeated K times: a data mixture; other splits unchanged), or the path of a JSON file holding a list of
``{"query", "response"}`` objects (for such a file, the "validation" split is a fixed 5% held out from
it, at least 1 example).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Iterable

from refusion.training.objective import Pair

TINYBENCH = "tinybench"
PROMPT_SUFFIX = "\n"


def encode_prompt(tokenizer: Any, query: str) -> list[int]:
    """Token ids of the prompt ``query + "\\n"`` (no special tokens)."""
    return list(tokenizer.encode(query + PROMPT_SUFFIX, add_special_tokens=False))


def encode_response(tokenizer: Any, response: str, eos: bool = True) -> list[int]:
    """Token ids of a response, EOS appended when ``eos``."""
    ids = list(tokenizer.encode(response, add_special_tokens=False))
    if eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token")
        ids.append(int(tokenizer.eos_token_id))
    return ids


def encode_pair(tokenizer: Any, query: str, response: str) -> Pair:
    return encode_prompt(tokenizer, query), encode_response(tokenizer, response)


def load_json_texts(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(query, response)`` pairs of a JSON list of ``{"query", "response"}`` objects."""
    with open(path, encoding="utf-8") as fh:
        rows = json.load(fh)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of {{'query', 'response'}} objects")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("query"), str) or not isinstance(row.get("response"), str):
            raise ValueError(f"{path}: item {i} is not an object with string 'query' and 'response'")
        out.append((row["query"], row["response"]))
    return out


def _json_split(texts: list[tuple[str, str]], split: str) -> list[tuple[str, str]]:
    idx = list(range(len(texts)))
    random.Random(1234).shuffle(idx)
    n_val = max(1, len(texts) // 20) if len(texts) > 1 else 0
    held = set(idx[:n_val])
    if split in ("validation", "val", "test"):
        return [texts[i] for i in sorted(held)]
    if split == "train":
        return [texts[i] for i in range(len(texts)) if i not in held]
    if split == "all":
        return list(texts)
    raise ValueError(f"unknown split {split!r}")


def tinybench_mix(data: str | os.PathLike) -> dict[str, int] | None:
    """Per-task repeats of the train split when ``data`` names tinybench (``"tinybench"``: 1 each;
    ``"tinybench:facts=3"``: facts 3, the others 1); None for anything else (a JSON file's path)."""
    from refusion.tasks import TASKS

    name, sep, spec = str(data).partition(":")
    if name != TINYBENCH:
        return None
    mix = dict.fromkeys(TASKS, 1)
    for item in spec.split(",") if sep else []:
        task, _, k = item.partition("=")
        if task.strip() not in TASKS or not k.strip().isdigit() or int(k) < 1:
            raise ValueError(f"data {str(data)!r}: each item of a tinybench mix is TASK=K with TASK one of "
                             f"{', '.join(TASKS)} and K a whole number >= 1, got {item!r}")
        mix[task.strip()] = int(k)
    return mix


def load_texts(data: str | os.PathLike, split: str = "train", limit: int | None = None) -> list[tuple[str, str]]:
    """``(query, response)`` texts of ``data`` (tinybench, a tinybench mix, or a JSON file) for ``split``;
    ``limit``: only the first ``limit`` examples of the data (of a mix: before its repeats)."""
    mix = tinybench_mix(data)
    if mix is not None:
        from refusion.tasks import corpus

        if split == "val":
            split = "validation"
        examples = corpus(split)[:limit]
        repeats = mix if split == "train" else dict.fromkeys(mix, 1)
        by_task = {name: [(e.query, e.response) for e in examples if e.task == name] for name in repeats}
        return [text for name, k in repeats.items() for text in by_task[name] * k]
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"training data {str(data)!r} is neither 'tinybench' nor a JSON file")
    return _json_split(load_json_texts(path), split)[:limit]


def tokenize_texts(
    tokenizer: Any, texts: Iterable[tuple[str, str]], max_length: int | None = None,
) -> tuple[list[Pair], int]:
    """Encode texts to pairs; pairs longer than ``max_length`` tokens in total are dropped.

    Returns ``(pairs, n_dropped)``.
    """
    pairs: list[Pair] = []
    dropped = 0
    for query, response in texts:
        p, r = encode_pair(tokenizer, query, response)
        if max_length is not None and len(p) + len(r) > max_length:
            dropped += 1
            continue
        pairs.append((p, r))
    return pairs, dropped


def load_pairs(
    data: str | os.PathLike, tokenizer: Any, split: str = "train", max_length: int | None = None,
    limit: int | None = None,
) -> list[Pair]:
    """Tokenised pairs of ``data`` for ``split``; raises when every example is longer than ``max_length``."""
    texts = load_texts(data, split, limit)
    pairs, dropped = tokenize_texts(tokenizer, texts, max_length)
    if texts and not pairs:
        raise ValueError(f"all {len(texts)} examples of {data} ({split}) are longer than max_length={max_length}")
    return pairs


def tokenizer_training_texts(data: str | os.PathLike) -> list[str]:
    """Texts to train a tokenizer on (queries with their newline and responses, separately)."""
    split = "all" if tinybench_mix(data) is None else "train"
    return [s for q, r in load_texts(data, split) for s in (q + PROMPT_SUFFIX, r)]
