
import pytest
from engine_helpers import CHAT_TEMPLATE, write_tokenizer_dir

from foretell.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

# Characters outside the training corpus too, so SentencePiece falls back to byte tokens.
TEXT = "héllo wörld — 日本語のテキスト 🙂🚀 naïve café 한국어 ℵ🎉"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detok = tokenizer.detokenizer()
    return [detok.add(i) for i in ids] + [detok.flush()]


def splits_a_character(tokenizer: Tokenizer, ids: list[int]) -> bool:
    """Whether some token ends in the middle of a UTF-8 character."""
    return any("\ufffd" in tokenizer.decode(ids[: i + 1]) for i in range(len(ids) - 1))


@pytest.fixture
def byte_level(tmp_path, byte_level_tokenizer):
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path, byte_level_tokenizer, {}))


@pytest.fixture
def metaspace(tmp_path, metaspace_tokenizer):
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path, metaspace_tokenizer, config))


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_streaming_never_emits_a_broken_character(kind, request):
    tokenizer = request.getfixturevalue(kind)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert splits_a_character(tokenizer, ids), "the test text must split characters across tokens"
    pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT


def test_unknown_decoders_fall_back_to_re_decoding(tmp_path, byte_level_tokenizer):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders

    odd = Backend.from_str(byte_level_tokenizer.to_str())
    # A trailing strip of the fused text cannot be streamed (it needs the end), forcing the
    # fallback path; TEXT has no trailing space, so its decoding is unchanged.
    odd.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 0, 1)])
    tokenizer = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, odd, {}))
    ids = tokenizer.encode(TEXT)
    assert type(tokenizer.detokenizer()).__name__ == "RedecodingDetokenizer"
    pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == TEXT


def test_eos_ids_come_from_all_three_files(tmp_path, byte_level_tokenizer):
    vocab = byte_level_tokenizer.get_vocab()
    path = write_tokenizer_dir(
        tmp_path,
        byte_level_tokenizer,
        {"eos_token": "<|im_end|>"},
        model_config={"eos_token_id": 7},
        generation_config={"eos_token_id": [vocab["<|endoftext|>"], 9]},
    )
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.eos_token_ids == {vocab["<|im_end|>"], 7, vocab["<|endoftext|>"], 9}


def test_a_bad_eos_id_names_its_file(tmp_path, byte_level_tokenizer):
    path = write_tokenizer_dir(
        tmp_path, byte_level_tokenizer, {}, generation_config={"eos_token_id": "2"}
    )
    with pytest.raises(TokenizerError, match=r"generation_config\.json: eos_token_id must be"):
        Tokenizer.from_dir(path)


def test_an_eos_token_outside_the_vocabulary_names_tokenizer_config(tmp_path, byte_level_tokenizer):
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {"eos_token": {"content": "<nope>"}})
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: eos_token '<nope>' is not in"
    ):
        Tokenizer.from_dir(path)


def test_a_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        Tokenizer.from_dir(tmp_path)


def test_a_corrupt_tokenizer_config_is_named(tmp_path, byte_level_tokenizer):
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {})
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: cannot read it as JSON"):
        Tokenizer.from_dir(path)


def test_add_bos_token_is_enforced_both_ways(tmp_path, metaspace_tokenizer):
    bos = metaspace_tokenizer.token_to_id("<s>")
    on = Tokenizer.from_dir(
        write_tokenizer_dir(tmp_path / "on", metaspace_tokenizer, {"bos_token": "<s>"})
    )
    assert on.encode("the fox")[0] == bos  # the post-processor adds it
    off = Tokenizer.from_dir(
        write_tokenizer_dir(
            tmp_path / "off", metaspace_tokenizer, {"bos_token": "<s>", "add_bos_token": False}
        )
    )
    assert off.encode("the fox")[0] != bos
    assert off.encode("the fox") == on.encode("the fox")[1:]
    assert on.encode("the fox", add_special_tokens=False) == off.encode("the fox")


def test_chat_template_renders_conversation_and_generation_prompt(tmp_path, byte_level_tokenizer):
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {"chat_template": CHAT_TEMPLATE})
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.has_chat_template
    assert tokenizer.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_chat_template_matches_transformers(tmp_path, byte_level_tokenizer):
    transformers = pytest.importorskip("transformers")
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "[{{ m.role }}] {{ m.content | tojson }}\n{% endfor %}"
        "{% if tools %}tools: {{ tools | tojson(indent=2) }}{% endif %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    config = {"chat_template": template, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, config)
    tools = [{"name": "lookup", "parameters": {"q": "ünïcode"}}]
    messages = [*MESSAGES, {"role": "user", "content": 'say "café" <b>'}]
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, tools=tools)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        chat_template=template,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )
    assert ours == hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )


def test_a_chat_template_jinja_file_wins(tmp_path, byte_level_tokenizer):
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {"chat_template": "from config"})
    (path / "chat_template.jinja").write_text("from file: {{ messages[0].content }}")
    assert Tokenizer.from_dir(path).apply_chat_template(MESSAGES) == "from file: Be brief."


def test_named_templates_use_the_default_one(tmp_path, byte_level_tokenizer):
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "plain"},
    ]
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {"chat_template": templates})
    assert Tokenizer.from_dir(path).apply_chat_template(MESSAGES) == "plain"


def test_raise_exception_in_a_template_is_a_one_line_error_naming_the_file(
    tmp_path, byte_level_tokenizer
):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {"chat_template": template})
    with pytest.raises(
        ChatTemplateError, match=r"tokenizer_config\.json: .*first message must be the user"
    ):
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)


def test_a_template_that_does_not_parse_names_its_file(tmp_path, byte_level_tokenizer):
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {})
    (path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(
        ChatTemplateError, match=r"chat_template\.jinja: the chat template does not parse"
    ):
        Tokenizer.from_dir(path)


def test_the_template_sandbox_blocks_attribute_escapes(tmp_path, byte_level_tokenizer):
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    path = write_tokenizer_dir(tmp_path, byte_level_tokenizer, {"chat_template": template})
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)


def test_no_template_is_an_error_that_says_what_to_do(byte_level):
    assert not byte_level.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        byte_level.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize("special", [True, False])
def test_encode_gives_the_backends_own_ids(kind, special, request):
    """``encode`` goes through the backend's batch call (it lets go of the interpreter while
    it works); the ids are the single call's, special tokens or not."""
    tokenizer = request.getfixturevalue(kind)
    for text in ("", "a", TEXT, TEXT * 40, "the fox\n\n  jumps"):
        ids = tokenizer.backend.encode(text, add_special_tokens=special).ids
        assert tokenizer.encode(text, add_special_tokens=special)[-len(ids) or None:] == ids


def test_encoding_lets_other_threads_run(byte_level):
    """A long prompt's tokenizing leaves the interpreter to other threads (a server's worker
    builds steps meanwhile): a counting thread gets far more done than it could in the
    switch-interval slices a call holding the interpreter leaves it."""
    import sys
    import threading

    text = TEXT * 4000
    counts, done = [0], threading.Event()

    def count() -> None:
        while not done.is_set():
            counts[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # a holder of the interpreter keeps it the whole call
    counter = threading.Thread(target=count)
    try:
        counter.start()
        while counts[0] < 1000:  # running (after one interval, this thread's turn is back)
            pass
        before = counts[0]
        byte_level.encode(text)
        during = counts[0] - before
    finally:
        done.set()
        counter.join()
        sys.setswitchinterval(old)
    assert during > 10_000
