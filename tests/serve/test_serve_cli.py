"""``foretell serve``'s own flags: checked before the model loads, the key from the
environment, and a missing extra named."""

from __future__ import annotations

import importlib.util

import pytest
from serve_helpers import Server

from foretell.cli import main


@pytest.mark.parametrize(("flags", "says"), [
    (["--port", "70000"], "serve.port: must be <= 65535, got 70000 (set by --port)"),
    (["--max-rows", "0"], "serve.max_rows: must be >= 1, got 0 (set by --max-rows)"),
    (["--kv-budget-gb", "-1"], "serve.kv_budget_gb: must be > 0.0, got -1.0 (set by --kv-budget-gb)"),
])
def test_bad_server_flags_are_one_line_naming_the_flag(flags, says, capsys):
    assert main(["serve", *flags]) == 1
    assert says in capsys.readouterr().err


def test_a_missing_serve_extra_is_named_with_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llguidance" else real(name, *a))
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "needs llguidance" in err and "pip install '.[serve]'" in err


def test_the_api_key_may_come_from_the_environment(tiny_model, tmp_path):
    server = Server("--model", str(tiny_model), cwd=tmp_path,
                    env={"FORETELL_API_KEY": "from-env"})
    try:
        assert server.request("GET", "/v1/models")[0] == 401
        assert server.request("GET", "/v1/models",
                              headers={"Authorization": "Bearer from-env"})[0] == 200
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(("flags", "warmed"), [([], True), (["--no-warm-shapes"], False)])
def test_the_server_warms_its_batch_shapes_unless_told_not_to(tiny_model, monkeypatch, flags,
                                                               warmed):
    from foretell.cli import serve_cmd
    from foretell.serve import server

    seen = []
    monkeypatch.setattr(serve_cmd, "_warm_batches", lambda scheduler: seen.append(scheduler))
    monkeypatch.setattr(server, "serve", lambda backend, sock, **kw: sock.close() or 0)
    assert main(["serve", "--model", str(tiny_model), "--port", "0", "--draft", "none",
                 *flags]) == 0
    assert [s.max_rows for s in seen] == ([32] if warmed else [])
