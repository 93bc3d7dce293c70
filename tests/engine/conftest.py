"""Fixtures for engine tests; plain helpers live in engine_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import (
    CHAT_TEMPLATE,
    MlxLmAdapter,
    tiny_qwen3,
    train_byte_level,
    train_metaspace,
    write_tokenizer_dir,
)


@pytest.fixture(scope="session")
def byte_level_tokenizer():
    return train_byte_level()


@pytest.fixture(scope="session")
def metaspace_tokenizer():
    return train_metaspace()


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory, byte_level_tokenizer) -> Path:
    """A Qwen-like tokenizer directory: byte-level BPE, ChatML template, EOS <|im_end|>."""
    return write_tokenizer_dir(
        tmp_path_factory.mktemp("chat"),
        byte_level_tokenizer,
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE},
        generation_config={"eos_token_id": [byte_level_tokenizer.token_to_id("<|endoftext|>")]},
    )


@pytest.fixture(scope="session")
def engine(chat_dir):
    from foretell import Engine
    from foretell.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(chat_dir)
    return Engine(MlxLmAdapter(tiny_qwen3(tokenizer.vocab_size)), tokenizer, path=chat_dir)
