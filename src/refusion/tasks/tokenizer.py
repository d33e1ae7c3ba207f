"""The tinybench tokenizer: the byte-level BPE of :mod:`refusion.models.tokenizer`, trained on the
tinybench train split (the shipped checkpoints' tokenizer)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from refusion.models.tokenizer import train_tokenizer


def build_tinybench_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """The tokenizer of the tinybench models: trained on every train prompt and response, separately.

    The facts option markers (`` (A)`` .. `` (D)``) are whole tokens, so that an option's line in the
    query and its step in the answer's walk start with the same one token (see :mod:`refusion.tasks.facts`).
    """
    from refusion.tasks import corpus
    from refusion.tasks.facts import OPTION_MARKERS

    examples = corpus("train")
    texts = [e.query + "\n" for e in examples] + [e.response for e in examples]
    return train_tokenizer(texts, vocab_size, whole_tokens=OPTION_MARKERS)
