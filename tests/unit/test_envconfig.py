"""Options from the environment (tiny_mindie/config/env.py) and the JSON log format
(tiny_mindie/service/logs.py), in-process; one subprocess for the exit status of a bad variable."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys

import pytest

from tiny_mindie.cli.main import ENV_COMMANDS, _config_from_args, build_parser
from tiny_mindie.config.env import EnvError, apply_env, env_name, env_options
from tiny_mindie.config.load import ConfigError, load_config
from tiny_mindie.server.conn import request_id
from tiny_mindie.service.logs import JSONFormatter


def parse(argv: list[str], environ: dict) -> argparse.Namespace:
    """What ``main`` does before running a command."""
    p = build_parser()
    apply_env(p, argv, environ)
    return p.parse_args(argv)


def serve_parser() -> argparse.ArgumentParser:
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "serve"]


def test_every_serve_option_has_a_variable_shown_in_help_with_its_default():
    sp = serve_parser()
    options = [a for a in sp._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 15
    help_text = " ".join(sp.format_help().split())
    for a in options:
        name = env_name(a)
        assert name == "TINY_MINDIE_" + a.option_strings[0][2:].replace("-", "_").upper()
        assert name in help_text, name
        assert "default" in a.help.lower(), a.help
    assert "[env TINY_MINDIE_CONFIG or MIES_CONFIG_JSON_PATH]" in help_text
    assert "[env TINY_MINDIE_NO_TLS=1]" in help_text
    assert "Precedence: the command line, then the environment, then the config file" in help_text


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps({"ServerConfig": {"port": 2000}}))
    file = {"TINY_MINDIE_CONFIG": str(cfg_file)}

    def port(argv, environ):
        return _config_from_args(parse(["serve", *argv], environ)).server.port

    assert port([], {}) == 1025
    assert port([], file) == 2000
    assert port([], {**file, "TINY_MINDIE_PORT": "3000"}) == 3000
    assert port(["--port", "4000"], {**file, "TINY_MINDIE_PORT": "3000"}) == 4000
    assert port([], {**file, "TINY_MINDIE_PORT": ""}) == 2000      # empty = unset


def test_config_path_from_mindie_variable_and_ours_wins(tmp_path):
    ours, mindie = tmp_path / "ours.json", tmp_path / "mindie.json"
    ours.write_text(json.dumps({"ServerConfig": {"port": 2001}}))
    mindie.write_text(json.dumps({"ServerConfig": {"port": 2002}}))
    assert parse(["serve"], {"MIES_CONFIG_JSON_PATH": str(mindie)}).config == str(mindie)
    both = {"MIES_CONFIG_JSON_PATH": str(mindie), "TINY_MINDIE_CONFIG": str(ours)}
    assert _config_from_args(parse(["serve"], both)).server.port == 2001
    assert parse(["serve", "--config", "x.json"], both).config == "x.json"


@pytest.mark.parametrize("value,tls", [("1", False), ("true", False), ("YES", False),
                                       ("on", False), ("0", True), ("false", True),
                                       ("off", True)])
def test_switch_values(value, tls):
    args = parse(["serve"], {"TINY_MINDIE_NO_TLS": value})
    assert _config_from_args(args).server.https_enabled is tls


@pytest.mark.parametrize("env,needle", [
    ({"TINY_MINDIE_PORT": "abc"}, "TINY_MINDIE_PORT: invalid int value 'abc'"),
    ({"TINY_MINDIE_NO_TLS": "maybe"}, "TINY_MINDIE_NO_TLS: expected 1/true/yes/on or "
                                      "0/false/no/off, got 'maybe'"),
    ({"TINY_MINDIE_LOG_FORMAT": "xml"}, "TINY_MINDIE_LOG_FORMAT: invalid choice 'xml' "
                                        "(choose from text, json)"),
    ({"TINY_MINDIE_BACKEND": "torch"}, "TINY_MINDIE_BACKEND: invalid choice 'torch'"),
])
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(EnvError, match=f"^{needle}".replace("(", r"\(").replace(")", r"\)")):
        apply_env(build_parser(), ["serve"], env)


def test_bad_value_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "serve"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "TINY_MINDIE_PORT": "80x"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "tiny_mindie: error: TINY_MINDIE_PORT: invalid int value '80x'\n"


def test_in_json_mode_a_fatal_configuration_error_is_a_json_record_too():
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "serve", "--port", "70000"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TINY_MINDIE_LOG_FORMAT": "json"})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r
    record = json.loads(r.stderr)
    assert record["level"] == "ERROR" and record["logger"] == "tiny_mindie"
    assert record["message"] == "--port: ServerConfig.port must be 0 or in 1024..65535, got 70000"


@pytest.mark.parametrize("argv,env,message", [
    ([], {"TINY_MINDIE_PORT": "80"},
     "TINY_MINDIE_PORT: ServerConfig.port must be 0 or in 1024..65535, got 80"),
    (["--port", "80"], {"TINY_MINDIE_PORT": "2000"},
     "--port: ServerConfig.port must be 0 or in 1024..65535, got 80"),
    ([], {"TINY_MINDIE_HOST": "a..b"}, 'TINY_MINDIE_HOST: ServerConfig.ipAddress must be an IP '
                                       'address or a host name (letters, digits, hyphens and '
                                       'dots), got "a..b"'),
    ([], {"TINY_MINDIE_DRAIN_TIMEOUT": "nan"},
     "TINY_MINDIE_DRAIN_TIMEOUT: ServerConfig.drainTimeout must be a finite number, got nan"),
    (["--drain-timeout", "inf"], {},
     "--drain-timeout: ServerConfig.drainTimeout must be a finite number, got inf"),
    ([], {"TINY_MINDIE_MAX_SEQ_LEN": "1"}, "TINY_MINDIE_MAX_SEQ_LEN: BackendConfig."
                                           "ModelDeployConfig.maxSeqLen must be in 2..1048576 "
                                           "tokens, got 1"),
])
def test_a_bad_value_names_the_flag_or_variable_it_came_from(argv, env, message):
    with pytest.raises(ConfigError) as err:
        _config_from_args(parse(["serve", *argv], env))
    assert str(err.value) == message


def test_nan_has_the_same_words_from_the_file_the_variable_and_the_flag(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"ServerConfig": {"drainTimeout": NaN}}')
    words = "ServerConfig.drainTimeout must be a finite number, got nan"
    with pytest.raises(ConfigError, match=f"^{words}$"):
        _config_from_args(parse(["serve", "--config", str(cfg)], {}))
    with pytest.raises(ConfigError, match=f"^TINY_MINDIE_DRAIN_TIMEOUT: {words}$"):
        _config_from_args(parse(["serve"], {"TINY_MINDIE_DRAIN_TIMEOUT": "NaN"}))
    with pytest.raises(ConfigError, match=f"^--drain-timeout: {words}$"):
        _config_from_args(parse(["serve", "--drain-timeout", "nan"], {}))
    with pytest.raises(ConfigError, match=f"^{words}$"):     # the dataclasses' own check
        load_config(None).with_overrides(**{"server.drain_timeout": math.nan})


def test_a_bad_variable_is_named_in_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "serve"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "TINY_MINDIE_PORT": "80"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("tiny_mindie: error: TINY_MINDIE_PORT: ServerConfig.port must be 0 or "
                        "in 1024..65535, got 80\n")


def test_the_probe_names_a_bad_variable_too(monkeypatch, capsys):
    from tiny_mindie.cli import health as health_probe

    monkeypatch.setenv("TINY_MINDIE_PORT", "80")
    assert health_probe.main(["ready", "--no-tls"]) == 1
    assert capsys.readouterr().err == ("tiny_mindie health: ready: TINY_MINDIE_PORT: "
                                       "ServerConfig.port must be 0 or in 1024..65535, got 80\n")


def test_other_commands_ignore_the_variables_and_unknown_ones_are_reported():
    bad = {"TINY_MINDIE_PORT": "abc", "TINY_MINDIE_PROT": "1", "TINY_MINDIE_CACHE": "/c",
           "TINY_MINDIE_HOME": "/h", "TINY_MINDIE_TEST_BACKEND": "numpy"}
    for argv in (["list-models"], ["pull", "x"], ["--version"]):
        assert apply_env(build_parser(), argv, bad) == []
    env = {k: v for k, v in bad.items() if k != "TINY_MINDIE_PORT"}
    assert apply_env(build_parser(), ["serve"], env) == ["TINY_MINDIE_PROT"]


def test_any_subcommand_can_take_the_environment():
    """How ``health`` (or any later subcommand) gets it: listed in cli.ENV_COMMANDS, or
    env_options() on its parser; options added later are covered as long as it runs last."""
    assert ENV_COMMANDS.get("health") is False
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    h = sub.add_parser("health")
    h.add_argument("which", nargs="?", default="ready")
    for flag in ("--config", "--host"):
        h.add_argument(flag)
    h.add_argument("--port", type=int)
    env_options(h)
    env = {"TINY_MINDIE_PORT": "8443", "MIES_CONFIG_JSON_PATH": "/etc/mindie/config.json",
           "TINY_MINDIE_MODEL": "other"}          # a serve option: not health's business
    assert apply_env(p, ["health", "live"], env) == []
    args = p.parse_args(["health", "live", "--host", "::1"])
    assert (args.which, args.port, args.config, args.host) == (
        "live", 8443, "/etc/mindie/config.json", "::1")
    with pytest.raises(TypeError, match="--tag"):
        h.add_argument("--tag", action="append")
        env_options(h)


def test_json_log_lines():
    fmt = JSONFormatter()
    rec = logging.LogRecord("tiny_mindie.access", logging.INFO, __file__, 1, '"GET /x" %s', (200,),
                            None)
    rec.fields = {"request_id": "r1", "status": 200, "odd": object(), "message": "ignored"}
    obj = json.loads(fmt.format(rec))
    assert obj["timestamp"].endswith("Z") and "T" in obj["timestamp"]
    assert (obj["level"], obj["logger"], obj["message"]) == ("INFO", "tiny_mindie.access",
                                                             '"GET /x" 200')
    assert obj["request_id"] == "r1" and obj["odd"].startswith("<object")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = fmt.format(rec)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exception"]


class _Req:
    def __init__(self, value):
        self.value = value

    def header(self, name):
        return self.value


@pytest.mark.parametrize("given,kept", [("abc-123", True), ("x" * 128, True), ("x" * 129, False),
                                        ("", False), ("a b", False), ("caf\u00e9", False),
                                        (None, False)])
def test_request_id_kept_when_sane(given, kept):
    rid = request_id(_Req(given))
    assert rid == given if kept else (len(rid) == 32 and int(rid, 16) >= 0)
