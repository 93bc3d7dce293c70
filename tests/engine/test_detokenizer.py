"""Streaming detokenization equals ``tokenizers``' decoding of the whole sequence, for
every tokenizer family: random id sequences (seeded, so reproducible), including the
invalid byte runs, special tokens and whitespace tokens that real generations produce.

Each family is a small tokenizer.json built here with the ``tokenizers`` library, in the
shape of the real ones (GPT-2/Qwen byte-level BPE, Llama-2 and Gemma SentencePiece with
byte fallback, Mistral-v3 Metaspace, BERT WordPiece, WordLevel without a decoder).
"""

import random

import pytest
from engine_helpers import write_tokenizer_dir
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from foretell.detokenizer import RedecodingDetokenizer, StreamingDetokenizer
from foretell.tokenizer import Tokenizer

BYTES = [f"<0x{i:02X}>" for i in range(256)]
PIECES = ["▁", "▁▁", "▁▁▁▁", "▁a", "a▁", "▁▁b", "b", "▁the", "é", "日本", "\n", "▁\n", "\n\n",
          " ", "##", "a▁▁c"]  # fmt: skip
SPECIALS = ["<s>", "</s>", "<unk>"]


def sentencepiece(decoder, byte_fallback=True):
    vocab = {t: i for i, t in enumerate(SPECIALS + (BYTES if byte_fallback else []) + PIECES)}
    tok = Backend(models.BPE(vocab, [], byte_fallback=byte_fallback, unk_token="<unk>"))
    tok.decoder = decoder
    tok.add_special_tokens(["<start_of_turn>"])
    tok.add_tokens(["▁added", "\t"])
    return tok


def byte_level(byte_level_tokenizer):
    tok = Backend.from_str(byte_level_tokenizer.to_str())
    tok.add_tokens(["héllo", "\n\n"])  # added tokens outside and inside the byte alphabet
    return tok


def word_level(decoder=None):
    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "hello", "world", "\n", "\n\n",
                                         ".", ",", "'", "s", "n't", "do", "not", "##ing",
                                         "##s", "go", "?", "##", " "])}  # fmt: skip
    return vocab, decoder


def wordlevel_no_decoder():
    vocab, _ = word_level()
    tok = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(["[SEP]"])
    return tok


def wordpiece(decoder):
    vocab, _ = word_level()
    tok = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.decoder = decoder
    tok.add_special_tokens(["[SEP]"])
    return tok


LLAMA2 = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
          decoders.Strip(" ", 1, 0)]  # fmt: skip
FAMILIES = {
    "byte-level (GPT-2, Qwen, Llama-3)": byte_level,
    "sentencepiece byte fallback + strip (Llama-2)": lambda _: sentencepiece(
        decoders.Sequence(LLAMA2)
    ),
    "sentencepiece byte fallback (Gemma)": lambda _: sentencepiece(
        decoders.Sequence(LLAMA2[:3])
    ),
    "metaspace prepend always": lambda _: sentencepiece(
        decoders.Metaspace(prepend_scheme="always"), byte_fallback=False
    ),
    "metaspace prepend first (Mistral-v3)": lambda _: sentencepiece(
        decoders.Metaspace(prepend_scheme="first")
    ),
    "metaspace prepend never": lambda _: sentencepiece(decoders.Metaspace(prepend_scheme="never")),
    "metaspace + byte fallback": lambda _: sentencepiece(
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    ),
    "wordlevel, no decoder": lambda _: wordlevel_no_decoder(),
    "wordpiece, no decoder": lambda _: wordpiece(None),
    "wordpiece decoder with cleanup (BERT)": lambda _: wordpiece(decoders.WordPiece()),
    "wordpiece decoder without cleanup": lambda _: wordpiece(decoders.WordPiece(cleanup=False)),
}


@pytest.fixture(params=FAMILIES.values(), ids=FAMILIES.keys())
def family(request, tmp_path, byte_level_tokenizer):
    backend = request.param(byte_level_tokenizer)
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path, backend, {}))


def streamed(tokenizer, ids):
    detok = tokenizer.detokenizer()
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_each_family_streams_without_re_decoding(family):
    assert isinstance(family.detokenizer(), StreamingDetokenizer)


def test_streamed_text_equals_decoding_the_whole_sequence(family):
    rng = random.Random(11)
    vocab = family.vocab_size
    invalid = 0
    for _ in range(600):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        expected = family.decode(ids)
        assert "".join(streamed(family, ids)) == expected, ids
        invalid += "\ufffd" in expected
    if any("\ufffd" in family.decode([i]) for i in range(vocab)):  # it decodes bytes
        assert invalid > 50, "the sequences must include invalid byte runs"


def test_streamed_text_equals_decoding_runs_of_whitespace_and_byte_tokens(family):
    """Sequences dense in the tokens the rules are about: several '▁', newlines, bytes."""
    vocab = family.backend.get_vocab(with_added_tokens=True)
    tricky = [i for t, i in vocab.items() if set(t) <= set("▁\n <>0x9ABCDEF#")]
    rng = random.Random(12)
    for _ in range(400):
        ids = [rng.choice(tricky) for _ in range(rng.randrange(1, 16))]
        assert "".join(streamed(family, ids)) == family.decode(ids), ids


def test_a_valid_byte_run_is_emitted_when_it_ends_not_later(tmp_path, byte_level_tokenizer):
    tokenizer = Tokenizer.from_dir(
        write_tokenizer_dir(tmp_path, sentencepiece(decoders.Sequence(LLAMA2[:3])), {})
    )
    vocab = tokenizer.backend.get_vocab()
    ids = [vocab["<0xE6>"], vocab["<0x97>"], vocab["<0xA5>"], vocab["b"]]
    assert streamed(tokenizer, ids) == ["", "", "", "日b", ""]


def test_an_unstreamable_decoder_falls_back_to_exact_re_decoding(tmp_path):
    tokenizer = Tokenizer.from_dir(
        write_tokenizer_dir(tmp_path, wordpiece(decoders.CTC()), {})
    )
    assert isinstance(tokenizer.detokenizer(), RedecodingDetokenizer)
    rng = random.Random(13)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert "".join(streamed(tokenizer, ids)) == tokenizer.decode(ids), ids
