"""The server stopped mid-run, then started again (empty, as a restarted server without
persistence comes back): one warning, generation goes on from RAM and computation with the
output it would have had, nothing is claimed durable that is not, and once the server is
back the cache stores there again; a server down when the tier opens is waited for too."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("redis", reason="the redis client is not installed (pip install "
                                    "./contrib/foretell-redis brings it)")

import foretell  # noqa: E402
from foretell.cache.tier import CacheTier  # noqa: E402
from foretell.tools import make_model_dir  # noqa: E402
from foretell_redis.layout import RedisConfig, RedisLayout  # noqa: E402

FIRST, SECOND, THIRD = list(range(5, 45)), list(range(50, 90)), list(range(100, 140))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("redis-outage") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def cold(model_dir):
    """What each prompt generates without any cache."""
    engine = foretell.load(model_dir)
    return {tuple(p): generate(engine, p)[0] for p in (FIRST, SECOND, THIRD)}


def generate(engine, prompt):
    events = list(engine.generate(prompt, max_tokens=6, ignore_eos=True))
    return [t for e in events[:-1] for t in e.tokens], events[-1]


def tier_over(engine, url):
    # retry_s=0: the server is tried again at the next request, however soon
    return CacheTier.for_engine(engine, url, layout=RedisLayout,
                                layout_config=RedisConfig(retry_s=0))


def outage_warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING
            and r.name == "foretell.store" and "cannot" in r.message]


def test_a_server_stopped_mid_run_then_started_again(own_server, model_dir, cold, caplog):
    engine = foretell.load(model_dir)
    engine.cache = tier_over(engine, own_server.url)
    assert generate(engine, FIRST)[0] == cold[tuple(FIRST)]
    assert engine.cache.flush(10).durable

    own_server.stop()
    with caplog.at_level(logging.WARNING):
        tokens, stats = generate(engine, SECOND)
        assert tokens == cold[tuple(SECOND)] and stats.cached_from is None
        tokens, stats = generate(engine, FIRST)  # RAM still serves what it holds
        assert tokens == cold[tuple(FIRST)] and stats.cached_from == "ram"
        report = engine.cache.flush(10)
    assert not report.durable  # SECOND's state never reached the server
    assert len(outage_warnings(caplog)) == 1

    own_server.start()  # on the same port, empty
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert generate(engine, THIRD)[0] == cold[tuple(THIRD)]
        assert engine.cache.flush(10).durable  # THIRD, and SECOND rewritten from RAM
    assert outage_warnings(caplog) == []
    elsewhere = foretell.load(model_dir)
    elsewhere.cache = tier_over(elsewhere, own_server.url)
    for prompt in (SECOND, THIRD):
        tokens, stats = generate(elsewhere, prompt)
        assert stats.cached_from == "ssd" and tokens == cold[tuple(prompt)]
    engine.cache.close(10)
    elsewhere.cache.close(10)


def test_a_server_down_when_the_tier_opens_is_used_once_it_answers(
        own_server, model_dir, cold, caplog):
    own_server.stop()
    engine = foretell.load(model_dir)
    with caplog.at_level(logging.WARNING):
        engine.cache = tier_over(engine, own_server.url)
        assert generate(engine, FIRST)[0] == cold[tuple(FIRST)]
    assert len(outage_warnings(caplog)) == 1
    own_server.start()
    engine.cache.flush(10)  # rewrites from RAM what it still holds
    elsewhere = foretell.load(model_dir)
    elsewhere.cache = tier_over(elsewhere, own_server.url)
    tokens, stats = generate(elsewhere, FIRST)
    assert stats.cached_from == "ssd" and tokens == cold[tuple(FIRST)]
    engine.cache.close(10)
    elsewhere.cache.close(10)
