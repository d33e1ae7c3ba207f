"""Shared fixtures: plugin autoload off, a tiny random Qwen3 with a character tokenizer that has a mask token."""

from __future__ import annotations

import os

os.environ["REFUSION_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # before any registry is built

import pytest
import torch
from helpers import make_char_tokenizer, make_tiny_qwen3
from transformers import PreTrainedTokenizerFast

from refusion.core.registry import set_registry
from refusion.models.backend import Backbone

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_registry():
    set_registry(None)
    yield
    set_registry(None)


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    return make_char_tokenizer()


@pytest.fixture
def backbone(char_tokenizer) -> Backbone:
    return Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer)
