"""``foretell serve`` reads the run config's ``[serve]`` table: the file's values reach the
server, flags (and ``$FORETELL_API_KEY`` for the key) win over it, and a bad key or type is
one line naming the file and the field."""

from __future__ import annotations

import socket

import pytest
from serve_helpers import Server

from foretell.cli import build_parser, main
from foretell.cli.serve_cmd import serve_config
from foretell.config import ServeSection, load_run_config
from foretell.errors import ConfigError
from foretell.plugin import PluginSwitches, load_plugins

FULL_TABLE = """
[serve]
host = "localhost"
port = 9191
api_key = "file-key"
served_model_name = "from-file"
max_rows = 3
max_waiting = 7
kv_budget_gb = 0.5
access_log = false
warm_shapes = false
"""


def settings(tmp_path, text, *flags, environ=None):
    """``(config, api_key)`` as ``foretell serve --config FILE *flags`` would start with."""
    path = tmp_path / "serve.toml"
    path.write_text(text, encoding="utf-8")
    args = build_parser().parse_args(["serve", "--config", str(path), *flags])
    _registry, config, key = serve_config(args, environ or {})
    return config, key


def test_the_files_serve_table_is_what_the_server_is_started_with(tmp_path):
    config, key = settings(tmp_path, FULL_TABLE)
    assert config.serve == ServeSection(
        host="localhost", port=9191, api_key="file-key", served_model_name="from-file",
        max_rows=3, max_waiting=7, kv_budget_gb=0.5, access_log=False, warm_shapes=False)
    assert key == "file-key"


def test_a_file_without_a_serve_table_gets_the_documented_defaults(tmp_path):
    config, key = settings(tmp_path, "max_tokens = 9\n")
    assert config.serve == ServeSection() and key is None
    assert (config.serve.host, config.serve.port) == ("127.0.0.1", 8080)


def test_flags_win_over_the_file(tmp_path):
    config, key = settings(
        tmp_path, FULL_TABLE, "--host", "127.0.0.1", "--port", "0", "--api-key", "flag-key",
        "--served-model-name", "from-flag", "--max-rows", "5", "--max-waiting", "0",
        "--kv-budget-gb", "2", "--access-log", "--warm-shapes")
    assert config.serve == ServeSection(
        host="127.0.0.1", port=0, api_key="flag-key", served_model_name="from-flag",
        max_rows=5, max_waiting=0, kv_budget_gb=2.0, access_log=True, warm_shapes=True)
    assert key == "flag-key"


def test_the_key_in_the_environment_wins_over_the_file_and_the_flag_over_both(tmp_path):
    env = {"FORETELL_API_KEY": "env-key"}
    assert settings(tmp_path, FULL_TABLE, environ=env)[1] == "env-key"
    assert settings(tmp_path, FULL_TABLE, "--api-key", "flag-key", environ=env)[1] == "flag-key"
    by_variable = '[serve]\napi_key_env = "MY_SERVE_KEY"\n'
    assert settings(tmp_path, by_variable, environ={**env, "MY_SERVE_KEY": "x"})[1] == "env-key"


def test_api_key_env_names_the_variable_the_key_is_read_from(tmp_path):
    config, key = settings(tmp_path, '[serve]\napi_key_env = "MY_SERVE_KEY"\n',
                           environ={"MY_SERVE_KEY": "from-variable"})
    assert key == "from-variable" and config.serve.api_key is None


@pytest.mark.parametrize("environ", [{}, {"MY_SERVE_KEY": ""}])
def test_an_api_key_env_that_holds_no_key_stops_the_server_from_starting_open(tmp_path, environ):
    with pytest.raises(ConfigError) as info:
        settings(tmp_path, '[serve]\napi_key_env = "MY_SERVE_KEY"\n', environ=environ)
    assert str(info.value) == (
        f"{tmp_path / 'serve.toml'}: serve.api_key_env: $MY_SERVE_KEY is not set or is empty "
        "in the server's environment: export the key in it, or leave api_key_env out to serve "
        "without a key")


@pytest.mark.parametrize(("table", "says"), [
    ("prot = 8080", "serve.prot: unknown field (known: access_log, api_key, api_key_env, host, "
                    "kv_budget_gb, max_rows, max_waiting, port, served_model_name, warm_shapes)"),
    ('port = "8080"', "serve.port: expected an integer, got '8080'"),
    ("port = 70000", "serve.port: must be <= 65535, got 70000"),
    ("max_rows = 0", "serve.max_rows: must be >= 1, got 0"),
    ("max_rows = 1.5", "serve.max_rows: expected an integer, got 1.5"),
    ("max_waiting = -1", "serve.max_waiting: must be >= 0, got -1"),
    ("kv_budget_gb = 0", "serve.kv_budget_gb: must be > 0.0, got 0.0"),
    ('access_log = "no"', "serve.access_log: expected true or false, got 'no'"),
    ('host = ""', "serve.host: must be an address or host name without spaces, got ''"),
    ('api_key = ""', "serve.api_key: must be printable ASCII, not empty, without surrounding "
                     "spaces (clients send it in an HTTP header)"),
    ('api_key_env = "$KEY"', "serve.api_key_env: must name an environment variable (letters, "
                             "digits and _, without '$'), got '$KEY'"),
    ('api_key = "k"\napi_key_env = "KEY"', "serve.api_key_env: give the key or the variable "
                                           "holding it, not both (api_key is also set)"),
])
def test_a_bad_key_or_type_is_one_line_naming_the_file_and_the_field(
        tmp_path, capsys, monkeypatch, table, says):
    monkeypatch.delenv("FORETELL_API_KEY", raising=False)  # it would replace the file's key
    path = tmp_path / "serve.toml"
    path.write_text(f"[serve]\n{table}\n", encoding="utf-8")
    assert main(["serve", "--config", str(path)]) == 1
    assert capsys.readouterr().err == f"foretell: error: {path}: {says}\n"


def test_a_refused_key_is_never_echoed(tmp_path):
    with pytest.raises(ConfigError) as info:
        settings(tmp_path, '[serve]\napi_key = " s3cret "\n')
    assert "serve.api_key" in str(info.value) and "s3cret" not in str(info.value)


def test_a_serve_table_in_a_run_config_is_accepted_by_run(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("max_tokens = 9\n" + FULL_TABLE, encoding="utf-8")
    registry = load_plugins(switches=PluginSwitches()).registry
    assert load_run_config(registry, path).max_tokens == 9  # one file serves both commands


def test_a_live_server_runs_as_its_config_file_says(tiny_model, tmp_path):
    taken = socket.socket()  # the file's port is in use: only the --port 0 flag can start it
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    file_port = taken.getsockname()[1]
    path = tmp_path / "serve.toml"
    path.write_text(
        f'model = "{tiny_model}"\n[serve]\nport = {file_port}\napi_key = "file-key"\n'
        f'served_model_name = "from-file"\nkv_budget_gb = 0.25\n'
        f'[cache]\ndir = "{tmp_path / "cache"}"\n', encoding="utf-8")
    server = Server("--config", str(path), cwd=tmp_path)
    try:
        assert server.port != file_port
        status, _, body = server.request("GET", "/v1/models")
        assert status == 401 and b"missing API key" in body
        assert server.request("GET", "/v1/models",
                              headers={"Authorization": "Bearer wrong"})[0] == 401
        status, _, body = server.request("GET", "/v1/models",
                                         headers={"Authorization": "Bearer file-key"})
        assert status == 200 and b'"from-file"' in body
        assert server.metrics()["foretell_kv_budget_bytes"] == 0.25 * 2**30
    finally:
        taken.close()
        assert server.stop() == 0
    assert "the cache is" in server.log  # said only when [cache] dir gave it a disk tier
