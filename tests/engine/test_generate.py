import time
from pathlib import Path

import mlx.core as mx
import pytest

import foretell
from foretell import engine as engine_module
from foretell import request as request_module
from foretell.config import SamplingConfig
from foretell.engine import GenerationError, ModelNotFound, resolve_model_path
from foretell.stream import StopMatcher

PROMPT = "the quick brown fox"


def run(engine, prompt=PROMPT, **options):
    events = list(engine.generate(prompt, **options))
    *texts, stats = events
    assert stats.type == "stats" and all(e.type == "text" for e in texts)
    tokens = [t for e in texts for t in e.tokens]
    return "".join(e.text for e in texts), tokens, stats


def mlx_lm_tokens(lm, ids, n, **kwargs):
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(mx.array(ids), lm, max_tokens=n, **kwargs)]


# -- parity with mlx-lm ----------------------------------------------------------------------


def test_greedy_is_token_identical_to_mlx_lm_across_prefill_chunks(engine, monkeypatch):
    monkeypatch.setattr(request_module, "PREFILL_CHUNK", 7)  # a 30-token prompt then takes 5 chunks
    prompt = list(range(3, 33))
    _, ours, _ = run(engine, prompt, max_tokens=24)
    assert ours == mlx_lm_tokens(engine.model.lm, prompt, 24)


def test_repetition_penalty_is_token_identical_to_mlx_lm(engine):
    from mlx_lm.sample_utils import make_repetition_penalty

    prompt = engine.encode_prompt(PROMPT)
    sampling = SamplingConfig(repetition_penalty=1.8, repetition_context_size=6)
    _, ours, _ = run(engine, prompt, max_tokens=24, sampling=sampling)
    theirs = mlx_lm_tokens(
        engine.model.lm, prompt, 24, logits_processors=[make_repetition_penalty(1.8, 6)]
    )
    assert ours == theirs
    assert ours != run(engine, prompt, max_tokens=24)[1]  # the penalty did change the output
    # The window starts inside the prompt. Cut the greedy continuation before a token whose
    # last use was ``b`` tokens back, at the first such cut where mlx-lm's penalty over a
    # window of exactly ``b`` changes the token that comes next; prompt with what comes
    # before it, with windows of ``b`` (the repeat at its far end) and ``b - 1`` (just
    # outside). A window one token short or one too long then serves another first token.
    greedy = run(engine, prompt, max_tokens=96, ignore_eos=True)[1]

    def theirs(ids, size, n=12):
        return mlx_lm_tokens(engine.model.lm, ids, n,
                             logits_processors=[make_repetition_penalty(1.8, size)])

    def back(n):
        return n - max(i for i in range(n) if greedy[i] == greedy[n]) if greedy[n] in greedy[:n] else 0

    cut = next(n for n in range(len(greedy)) if 2 < back(n) <= 8
               and theirs(prompt + greedy[:n], back(n), 1) != [greedy[n]])
    for size in (back(cut), back(cut) - 1):
        config = SamplingConfig(repetition_penalty=1.8, repetition_context_size=size)
        looping = prompt + greedy[:cut]
        ours = run(engine, looping, max_tokens=12, sampling=config, ignore_eos=True)[1]
        assert ours == theirs(looping, size), size


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    from foretell.tools import make_model_dir

    path = tmp_path_factory.mktemp("synthetic") / "qwen3"
    return make_model_dir(path, "qwen3", overrides={"tie_word_embeddings": False})


def test_loaded_model_generates_exactly_what_mlx_lm_does(synthetic_dir):
    import mlx_lm

    engine = foretell.load(synthetic_dir)
    lm, tokenizer = mlx_lm.load(str(synthetic_dir))
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    ids = engine.encode_prompt(messages)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text, ours, stats = run(engine, messages, max_tokens=32)
    expected = []
    for token in mlx_lm_tokens(lm, ids, 32):
        if token in tokenizer.eos_token_ids:
            break
        expected.append(token)
    assert ours == expected
    assert text == tokenizer.decode(ours)
    assert stats.prompt_tokens == len(ids)


# -- ending a generation ---------------------------------------------------------------------


def test_max_tokens_bounds_the_output(engine):
    _, tokens, stats = run(engine, max_tokens=5)
    assert len(tokens) == stats.generated_tokens == 5
    assert stats.finish_reason == "length"


def test_eos_ends_generation_and_is_never_emitted(engine, monkeypatch):
    text, tokens, _ = run(engine, max_tokens=12)
    eos = tokens[4]
    first = tokens.index(eos)
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({eos}))
    eos_text, eos_tokens, stats = run(engine, max_tokens=12)
    assert eos_tokens == tokens[:first]
    assert eos_text == engine.tokenizer.decode(tokens[:first])
    assert stats.finish_reason == "eos" and stats.generated_tokens == first + 1


def test_ignore_eos_generates_through_eos_to_max_tokens(engine, monkeypatch):
    _, tokens, _ = run(engine, max_tokens=12)
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({tokens[4]}))
    _, through, stats = run(engine, max_tokens=12, ignore_eos=True)
    assert through == tokens and stats.finish_reason == "length"


def test_a_stop_string_spanning_tokens_ends_generation_and_is_not_emitted(engine):
    _, tokens, _ = run(engine, max_tokens=16)
    pieces = [engine.tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    # a stop string that starts inside token 5's text and ends inside token 7's
    start = len(pieces[4]) - 1
    end = len(pieces[6]) - 1
    full = pieces[-1]
    stop = full[start:end]
    assert len(stop) >= 2 and full.find(stop) == start
    events = list(engine.generate(PROMPT, max_tokens=16, stop=[stop]))
    stats = events[-1]
    text = "".join(e.text for e in events[:-1])
    assert text == full[:start]
    assert stats.finish_reason == "stop"
    assert stop not in "".join(e.text for e in events[:-1])


def test_stop_matcher_holds_back_a_possible_stop_and_releases_it_when_it_diverges():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("a </") == ("a ", False)
    assert matcher.feed("e") == ("", False)
    assert matcher.feed("x>") == ("</ex>", False)
    assert matcher.feed("b</en") == ("b", False)
    assert matcher.feed("d> tail") == ("", True)


def test_a_lone_stop_string_is_one_stop_not_its_characters():
    assert StopMatcher("END").feed("DONE") == ("DON", False)  # "E" may start "END"


def test_stop_matcher_cuts_at_the_earliest_of_several_stops():
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == ("hel", True)


def test_text_held_for_a_stop_string_is_released_at_the_end(engine):
    text, tokens, _ = run(engine, max_tokens=8)
    tail_start = text[-1]
    held = list(engine.generate(PROMPT, max_tokens=8, stop=[tail_start + "\x00never"]))
    assert "".join(e.text for e in held[:-1]) == text
    assert held[-1].finish_reason == "length"


# -- streaming and stats ------------------------------------------------------------------


def test_streamed_text_is_the_decoded_tokens(engine):
    text, tokens, _ = run(engine, max_tokens=20)
    assert text == engine.tokenizer.decode(tokens)


def test_speeds_are_the_prompt_over_ttft_and_the_rest_over_the_time_after_it(engine, monkeypatch):
    from foretell.request import RequestState

    # The scheduler's worker reads the clock at every step; the stats are made of four
    # readings: the request's submission, its start (its admission), its first token, its end.
    state = RequestState(prompt=list(range(3, 14)), caches=[], cached=3,
                         generated=[5] * 6, consumed=6)
    monkeypatch.setattr(time, "perf_counter", lambda: 16.0)  # the end
    stats = engine._stats(state, 9.5, 10.0, 12.0)
    assert stats.ttft_s == 2.0 and stats.queued_s == 0.5
    assert stats.prompt_tps == (11 - 3) / 2.0
    assert stats.generation_tps == 6 / 4.0  # every generated token over the time after the first
    monkeypatch.undo()
    _, _, stats = run(engine, max_tokens=6)
    assert 0 < stats.ttft_s and stats.prompt_tps > 0 and stats.generation_tps > 0


def test_stats_describe_the_request(engine):
    _, tokens, stats = run(engine, max_tokens=6)
    assert stats.prompt_tokens == len(engine.encode_prompt(PROMPT))
    assert stats.cached_tokens == 0
    assert stats.generated_tokens == 6
    assert stats.peak_memory_gb == mx.get_peak_memory() / 1e9  # this request's peak
    assert set(stats.to_dict()) >= {
        "type",
        "prompt_tokens",
        "generated_tokens",
        "cached_tokens",
        "ttft_s",
        "prompt_tps",
        "generation_tps",
        "peak_memory_gb",
        "finish_reason",
    }


def test_prefill_progress_reports_chunks(engine, monkeypatch):
    monkeypatch.setattr(request_module, "PREFILL_CHUNK", 4)
    seen = []
    run(engine, list(range(3, 13)), max_tokens=2, prefill_progress=lambda d, t: seen.append((d, t)))
    assert seen == [(4, 9), (8, 9), (9, 9)]  # the last prompt token heads decoding


def test_a_seed_reproduces_a_sampled_generation(engine):
    sampling = SamplingConfig(temp=1.0, top_p=0.95, seed=1234)
    first = run(engine, max_tokens=16, sampling=sampling)[1]
    assert run(engine, max_tokens=16, sampling=sampling)[1] == first
    others = {
        tuple(run(engine, max_tokens=16, sampling=SamplingConfig(temp=1.0, seed=s))[1])
        for s in range(3)
    }
    assert len(others) > 1


# -- prompts -------------------------------------------------------------------------------


def test_text_prompts_go_in_raw_unless_chat_is_asked_for_as_in_mlx_lm(engine):
    # mlx-lm's Python generate() encodes text as it is, whatever template the tokenizer has.
    assert engine.tokenizer.has_chat_template
    assert engine.encode_prompt("hi") == engine.tokenizer.encode("hi")
    assert engine.encode_prompt("hi", chat=True) == engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]),
        add_special_tokens=False,
    )


def test_bad_prompts_are_refused_before_generating(engine):
    with pytest.raises(GenerationError, match="empty"):
        engine.generate([])
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.generate([1, 10**6])
    with pytest.raises(GenerationError, match="max_tokens"):
        engine.generate(PROMPT, max_tokens=0)


# -- model names -------------------------------------------------------------------------------


def test_a_directory_is_used_as_given(tmp_path):
    assert resolve_model_path(tmp_path) == tmp_path


def test_a_name_resolves_to_a_shipped_model(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    monkeypatch.setattr(engine_module, "DEMO_DIR", tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_model_path("tiny") == tmp_path / "tiny"


def test_a_model_directory_of_a_shipped_name_is_used_as_given(tmp_path, monkeypatch):
    for root in (tmp_path / "shipped", tmp_path / "here"):
        (root / "tiny").mkdir(parents=True)
        (root / "tiny" / "config.json").write_text("{}")
    monkeypatch.setattr(engine_module, "DEMO_DIR", tmp_path / "shipped")
    monkeypatch.chdir(tmp_path / "here")
    assert resolve_model_path("tiny") == Path("tiny")


def test_a_folder_that_is_no_model_does_not_shadow_the_shipped_model_of_its_name(
    tmp_path, monkeypatch
):
    (tmp_path / "shipped" / "tiny").mkdir(parents=True)
    (tmp_path / "shipped" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "here" / "tiny").mkdir(parents=True)  # e.g. tests/demo beside a run
    (tmp_path / "here" / "small").write_text("notes")
    (tmp_path / "shipped" / "small").mkdir()
    (tmp_path / "shipped" / "small" / "config.json").write_text("{}")
    monkeypatch.setattr(engine_module, "DEMO_DIR", tmp_path / "shipped")
    monkeypatch.chdir(tmp_path / "here")
    assert resolve_model_path("tiny") == tmp_path / "shipped" / "tiny"
    assert resolve_model_path("small") == tmp_path / "shipped" / "small"


def test_a_file_given_for_a_model_is_one_error_naming_it(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="weights.safetensors.*is a file; give the model"):
        resolve_model_path(tmp_path / "weights.safetensors")


def test_an_unknown_name_lists_the_shipped_models(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    monkeypatch.setattr(engine_module, "DEMO_DIR", tmp_path)
    with pytest.raises(ModelNotFound, match=r"^model .nope.: .*shipped models: tiny"):
        resolve_model_path("nope")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "gemma3_text", "gemma4_text"])
def test_every_architecture_decodes_like_mlx_lm_through_chunked_prefill(
    model_type, tmp_path, monkeypatch
):
    import mlx_lm

    from foretell.tools import make_model_dir

    path = make_model_dir(
        tmp_path / model_type, model_type, overrides={"tie_word_embeddings": False}
    )
    chunk = 16
    monkeypatch.setattr(request_module, "PREFILL_CHUNK", chunk)
    engine = foretell.load(path)
    lm, tokenizer = mlx_lm.load(str(path))
    ids = engine.encode_prompt("def fibonacci(n):\n" * 5, chat=False)
    assert len(ids) > 2 * chunk
    _, ours, _ = run(engine, ids, max_tokens=24)
    expected = []
    for token in mlx_lm_tokens(lm, ids, 24, prefill_step_size=chunk):
        if token in tokenizer.eos_token_ids:
            break
        expected.append(token)
    assert ours == expected


def test_a_prefill_releases_mlxs_cached_buffers_only_past_the_bound(engine, monkeypatch):
    """Freed buffers stay cached for the next forward (on CUDA releasing them returns them
    to the driver, and a server admitting requests would allocate them afresh each time)
    until they pass ``CACHE_KEEP_BYTES``; then the prefill releases them."""
    prompt = engine.encode_prompt(" ".join([PROMPT] * 100), chat=False)

    def cached_after_prefill() -> int:
        mx.clear_cache()
        request_module.prefill(engine.model, prompt, engine.make_caches())
        return mx.get_cache_memory()

    monkeypatch.setattr(request_module, "CACHE_KEEP_BYTES", 1 << 40)
    kept = cached_after_prefill()
    monkeypatch.setattr(request_module, "CACHE_KEEP_BYTES", 0)
    released = cached_after_prefill()  # (what the forward's last arrays free afterwards)
    assert kept > 4 * released
