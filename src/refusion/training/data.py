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

Multi-process training reads its data from a tokenised store instead (:func:`tokenized_store`): the main
process encodes the train and validation splits once into flat memory-mapped token arrays under a folder
named after a hash of the data, the tokenizer, ``max_length``, the prompt layout and ``limit``; the other
processes (and any rerun with the same inputs) open it with :func:`open_store` without tokenising, as
:class:`PairStore` sequences of pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Iterable

from refusion.core.objective import Pair

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


# ------------------------------------------------------------------------------ tokenised store
# Multi-process training tokenises its data ONCE: the main process writes the pairs of the train and
# validation splits into a folder of flat token arrays, the other processes wait and memory-map it (the
# page cache holds one copy for every process of a machine). A rerun with the same inputs reuses it.
STORE_FORMAT = 1
STORE_SPLITS = ("train", "validation")
STORE_META = "meta.json"
_ENCODE_CHUNK = 8192


class PairStore(Sequence):
    """The ``(prompt_ids, response_ids)`` pairs of one split of a tokenised store, read from memory-mapped
    arrays: ``{split}.tokens.bin`` (int32, every pair's prompt then response, back to back) and
    ``{split}.index.bin`` (int64 rows ``[start, prompt_len, response_len]``). Indexing returns lists of ints,
    as the in-memory pairs of :func:`load_pairs` are; a slice returns a list of pairs."""

    def __init__(self, folder: str | os.PathLike, split: str) -> None:
        import numpy as np

        self.folder, self.split = Path(folder), split
        meta = json.loads((self.folder / STORE_META).read_text())["splits"][split]
        self.n, n_tokens = int(meta["pairs"]), int(meta["tokens"])
        self.tokens = (np.memmap(self.folder / f"{split}.tokens.bin", dtype=np.int32, mode="r", shape=(n_tokens,))
                       if n_tokens else np.zeros(0, dtype=np.int32))
        self.index = (np.memmap(self.folder / f"{split}.index.bin", dtype=np.int64, mode="r", shape=(self.n, 3))
                      if self.n else np.zeros((0, 3), dtype=np.int64))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"pair {i} of {self.n}")
        start, p, r = (int(x) for x in self.index[i])
        ids = self.tokens[start : start + p + r].tolist()
        return ids[:p], ids[p:]

    def __repr__(self) -> str:
        return f"PairStore({str(self.folder)!r}, {self.split!r}, {self.n} pairs)"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_digest(tokenizer: Any, chat: bool) -> str:
    """What decides the token ids: the fast tokenizer's full definition (or the vocabulary), the EOS id,
    and with ``chat`` the chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(f"|eos={tokenizer.eos_token_id}|{type(tokenizer).__name__}".encode())
    if chat:
        h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def store_key(
    data: str | os.PathLike, tokenizer: Any, max_length: int | None = None, chat: bool = False,
    limit: int | None = None,
) -> dict[str, Any]:
    """Everything the stored pairs depend on: the data (a file's SHA-256, or the tinybench mix and its
    texts' hash), the tokenizer, ``max_length``, the prompt layout (plain ``query + "\\n"`` or the chat
    template) and ``limit``. The store's folder is named after a hash of it."""
    if tinybench_mix(data) is not None:
        h = hashlib.sha256()
        for split in STORE_SPLITS:
            h.update(json.dumps(load_texts(data, split, limit if split == "train" else None)).encode())
        source = {"tinybench": str(data), "texts_sha256": h.hexdigest()}
    else:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"training data {str(data)!r} is neither 'tinybench' nor a JSON file")
        source = {"file": str(path.resolve()), "bytes": path.stat().st_size, "sha256": _file_digest(path)}
    return {"format": STORE_FORMAT, "data": source, "tokenizer_sha256": _tokenizer_digest(tokenizer, chat),
            "max_length": max_length, "prompt": "chat_template" if chat else "query+newline", "limit": limit}


def store_folder(root: str | os.PathLike, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / f"pairs-{digest}"


def encode_texts(tokenizer: Any, texts: list[tuple[str, str]], chat: bool = False) -> list[Pair]:
    """Pairs of ``texts`` as :func:`encode_pair` makes them (``chat``: the prompt through the tokenizer's chat
    template, as :func:`refusion.models.tokenizer.encode_prompt` does), the plain prompts and the responses
    encoded a batch at a time by the fast tokenizer."""
    if not texts:
        return []
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token")
    if chat:
        from refusion.models.tokenizer import encode_prompt as chat_prompt

        prompts = [list(chat_prompt(tokenizer, q, chat=True)) for q, _ in texts]
    else:
        prompts = [list(ids) for ids in tokenizer([q + PROMPT_SUFFIX for q, _ in texts], add_special_tokens=False)["input_ids"]]
    responses = tokenizer([r for _, r in texts], add_special_tokens=False)["input_ids"]
    return [(p, list(r) + [int(eos)]) for p, r in zip(prompts, responses)]


def build_store(
    folder: str | os.PathLike, data: str | os.PathLike, tokenizer: Any, key: dict[str, Any],
    max_length: int | None = None, chat: bool = False, limit: int | None = None,
) -> dict[str, Any]:
    """Tokenise the train and validation splits of ``data`` into ``folder`` (written beside it and renamed
    into place, so a reader never sees half a store); returns its metadata."""
    import numpy as np

    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    splits: dict[str, Any] = {}
    for split in STORE_SPLITS:
        texts = load_texts(data, split, limit if split == "train" else None)
        n = n_tokens = dropped = 0
        with open(tmp / f"{split}.tokens.bin", "wb") as tok_fh, open(tmp / f"{split}.index.bin", "wb") as idx_fh:
            for lo in range(0, len(texts), _ENCODE_CHUNK):
                rows, flat = [], []
                for p, r in encode_texts(tokenizer, texts[lo : lo + _ENCODE_CHUNK], chat):
                    if max_length is not None and len(p) + len(r) > max_length:
                        dropped += 1
                        continue
                    rows.append((n_tokens, len(p), len(r)))
                    flat += p
                    flat += r
                    n_tokens += len(p) + len(r)
                    n += 1
                tok_fh.write(np.asarray(flat, dtype=np.int32).tobytes())
                idx_fh.write(np.asarray(rows, dtype=np.int64).reshape(-1, 3).tobytes())
        if texts and not n:
            shutil.rmtree(tmp)
            raise ValueError(f"all {len(texts)} examples of {data} ({split}) are longer than max_length={max_length}")
        splits[split] = {"pairs": n, "tokens": n_tokens, "dropped": dropped}
    meta = {"key": key, "splits": splits, "built_s": round(time.perf_counter() - t0, 2), "built_by_pid": os.getpid()}
    (tmp / STORE_META).write_text(json.dumps(meta, indent=1) + "\n")
    try:
        os.replace(tmp, folder)  # atomic; fails when another process put the store there first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / STORE_META).is_file():
            raise
    return json.loads((folder / STORE_META).read_text())


def tokenized_store(
    root: str | os.PathLike, data: str | os.PathLike, tokenizer: Any, max_length: int | None = None,
    chat: bool = False, limit: int | None = None,
) -> tuple[Path, bool]:
    """``(folder, built)``: the store of these inputs under ``root``, built now (``built``) or found from an
    earlier run (the key in its ``meta.json`` matches; nothing is tokenised)."""
    key = store_key(data, tokenizer, max_length, chat, limit)
    folder = store_folder(root, key)
    meta = folder / STORE_META
    if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
        return folder, False
    if folder.exists():  # a store of another format or an unfinished one: rebuild it
        shutil.rmtree(folder)
    build_store(folder, data, tokenizer, key, max_length, chat, limit)
    return folder, True


def open_store(folder: str | os.PathLike) -> dict[str, PairStore]:
    """The memory-mapped splits of a store: ``{"train": PairStore, "validation": PairStore}``."""
    return {split: PairStore(folder, split) for split in STORE_SPLITS}
