import pytest
from transformers import AutoTokenizer

from refusion.models.tokenizer import SPECIAL_TOKENS, train_tokenizer
from refusion.tasks.tokenizer import build_tinybench_tokenizer
from refusion.tasks import TASKS
from refusion.tasks.facts import OPTION_MARKERS


def _texts(n: int) -> list[str]:
    examples = [e for task in TASKS.values() for e in task.examples("train", n)]
    return [e.query + "\n" for e in examples] + [e.response for e in examples]


@pytest.fixture(scope="module")
def tokenizer():  # like the shipped one (whole option markers), on less text and with fewer merges
    return train_tokenizer(_texts(300), vocab_size=512, whole_tokens=OPTION_MARKERS)


def test_round_trip_is_exact(tokenizer):
    examples = [e for task in TASKS.values() for e in task.examples("validation", 50)]
    texts = [t for e in examples for t in (e.query + "\n", e.response)]
    texts += ["Zoë naïve ✓ 漢字\ttab  two  spaces\r\n", "    indented\n\n\nx = [1, -2]"]
    for text in texts:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_special_tokens(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS.values()]
    assert ids == [0, 1, 2, 3]
    specials = (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.mask_token_id)
    assert specials == (0, 1, 2, 3)
    assert tokenizer(SPECIAL_TOKENS["mask"] + "ab")["input_ids"][0] == 3
    assert len(tokenizer) == 512
    assert tokenizer("Ava has 3")["input_ids"][0] != tokenizer.bos_token_id  # nothing added implicitly


def test_digits_are_single_tokens_and_no_token_spans_a_line_start(tokenizer):
    assert [tokenizer.decode([i]) for i in tokenizer("= 107")["input_ids"]][-3:] == ["1", "0", "7"]
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    assert not any("\n" in p and not p.split("\n")[-1].isspace() and p.split("\n")[-1] for p in pieces)


def test_save_load_and_chat_template(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = TASKS["code"].examples("test", 1)[0].response
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.mask_token == SPECIAL_TOKENS["mask"] and loaded.mask_token_id == 3
    messages = [{"role": "user", "content": "What?"}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "What?\n"
    messages.append({"role": "assistant", "content": "#### 4"})
    assert loaded.apply_chat_template(messages, tokenize=False) == "What?\n#### 4" + SPECIAL_TOKENS["eos"]


def test_training_is_deterministic(tokenizer):
    again = train_tokenizer(_texts(300), vocab_size=512, whole_tokens=OPTION_MARKERS)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_max_new_tokens_cover_gold_responses():
    """Every gold response fits its task's budget in the tokenizer the shipped models use."""
    from refusion.models.loading import resolve_model_path

    shipped = AutoTokenizer.from_pretrained(resolve_model_path("tiny-ar"))
    for task in TASKS.values():
        responses = [e.response for split in ("validation", "test") for e in task.examples(split)]
        responses += [e.response for e in task.examples("train", 1000)]
        assert max(len(ids) for ids in shipped(responses)["input_ids"]) <= task.max_new_tokens, task.name


@pytest.mark.slow
def test_tinybench_tokenizer_is_deterministic_and_fits_the_budgets():
    first, second = build_tinybench_tokenizer(), build_tinybench_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 1024
    for task in TASKS.values():
        responses = [e.response for split in ("train", "validation", "test") for e in task.examples(split)]
        assert max(len(ids) for ids in first(responses)["input_ids"]) <= task.max_new_tokens, task.name


def test_whole_tokens_are_one_token_each_and_keep_the_vocabulary_size():
    tok = train_tokenizer(_texts(100), vocab_size=512, whole_tokens=OPTION_MARKERS)
    assert len(tok) == 512
    question = TASKS["facts"].examples("test", 1)[0]
    for text in (question.query + "\n", question.response):
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        pieces = [tok.decode([i]) for i in ids]
        assert sum(p in OPTION_MARKERS for p in pieces) == text.count(" (")  # each marker is one token
    assert tok(" (B)")["input_ids"] == [tok.convert_tokens_to_ids(" (B)")]
