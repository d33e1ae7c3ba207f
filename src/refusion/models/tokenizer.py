"""Byte-level BPE tokenizers for the tiny models, trained with the ``tokenizers`` library.

Pre-tokenization follows Qwen2/3: digits are split one per token (so arithmetic sees digits),
letters group into words with their leading space, and newlines and runs of spaces (code
indentation) are their own pieces; then bytes are mapped to the byte-level alphabet, so any text
round-trips exactly. The four special tokens take ids 0-3 in the order of :data:`SPECIAL_TOKENS`
(eos 0, pad 1, bos 2, mask 3).

Prompt format used everywhere: the prompt is ``query + "\\n"`` and is encoded on its own; the
response is encoded separately and followed by eos::

    prompt_ids = tokenizer(query + "\\n")["input_ids"]
    response_ids = tokenizer(response)["input_ids"] + [tokenizer.eos_token_id]

BPE merges never cross that boundary because the tokenizer is trained on prompts and responses as
separate texts and callers encode them separately. Encoding adds no special token (no bos). The
chat template renders the same thing: a user message as ``content + "\\n"``, an assistant message as
``content + eos``; ``add_generation_prompt`` adds nothing.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"eos": "<|endoftext|>", "pad": "<|pad|>", "bos": "<|beginoftext|>", "mask": "<|mask|>"}
# Qwen2's pre-tokenizer pattern: contractions, words, single digits, punctuation, newlines, spaces
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- else -%}{{ message['content'] + '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, whole_tokens: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``; ``vocab_size`` tokens in all, specials included.

    ``whole_tokens`` are strings always encoded as one token each (matched in the raw text before
    pre-tokenization); they take the last ids.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(whole_tokens), special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in whole_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS["eos"], pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"], mask_token=SPECIAL_TOKENS["mask"],
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    )


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, through the tokenizer's chat template when it has one and ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        ))
    return tokenizer.encode(text, add_special_tokens=False)
