"""Configuration rules and the command line's answers to bad input (no model load needed)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from tiny_mindie.config.load import ConfigError, load_config


def write(tmp_path, obj) -> str:
    p = tmp_path / "config.json"
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def run_cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "tiny_mindie", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_defaults_match_mindie():
    cfg = load_config(None)
    assert cfg.server.port == 1025 and cfg.server.https_enabled
    assert cfg.backend.model.max_seq_len == 2560 and cfg.max_input_len == 2048
    assert cfg.backend.schedule.max_iter_times == 512


def test_mindie_file_is_read_and_paths_resolve_against_it(tmp_path):
    cfg = load_config(write(tmp_path, {
        "ServerConfig": {"port": 2000, "managementPort": 2001, "metricsPort": 2002,
                         "tlsCert": "certs/s.pem", "SomethingElse": 1},
        "BackendConfig": {"npuDeviceIds": [[3]], "ModelDeployConfig": {
            "maxSeqLen": 100, "maxInputTokenLen": 200,
            "ModelConfig": [{"modelName": "m", "modelWeightPath": "/x.gguf"}]},
            "parallelRuns": 3, "batchInvariant": False,
            "ScheduleConfig": {"maxPrefillTokens": 99}}}))
    assert (cfg.server.port, cfg.server.management_port, cfg.server.metrics_port) == \
        (2000, 2001, 2002)
    assert cfg.path(cfg.server.tls_cert) == str(tmp_path / "certs" / "s.pem")
    assert cfg.max_input_len == 99          # min(maxInputTokenLen, maxSeqLen - 1)
    assert cfg.backend.npu_device_ids == (3,)
    assert cfg.backend.parallel_runs == 3 and cfg.backend.batch_invariant is False
    assert load_config(write(tmp_path, {})).backend.batch_invariant is True
    assert cfg.backend.model.model_name == "m"


@pytest.mark.parametrize("obj,needle", [
    ({"ServerConfig": {"port": 80}}, "port must be 0 or in 1024..65535"),
    ({"ServerConfig": {"maxLinkNum": 0}}, "maxLinkNum"),
    ({"ServerConfig": {"port": "1025"}}, "ServerConfig.port must be an integer, got \"1025\""),
    ({"BackendConfig": {"parallelRuns": True}}, "parallelRuns must be an integer, got true"),
    ({"BackendConfig": {"ScheduleConfig": {"maxPrefillTokens": 10}}}, "maxPrefillTokens"),
    ({"BackendConfig": {"ScheduleConfig": {"maxPrefillBatchSize": 300}}}, "maxPrefillBatchSize"),
    ({"BackendConfig": {"npuDeviceIds": "0"}}, "npuDeviceIds"),
    ({"BackendConfig": {"backend": "tensorflow"}}, "backend must be one of"),
    ({"BackendConfig": {"parallelRuns": -1}},
     "BackendConfig.parallelRuns must be in 0..1024, got -1"),
    ({"BackendConfig": {"batchInvariant": "no"}},
     "batchInvariant must be true or false, got \"no\""),
    ({"BackendConfig": {"ScheduleConfig": {"prefixCaching": 0}}},
     "prefixCaching must be true or false, got 0"),
    ({"BackendConfig": {"standardDtype": "bfloat16"}}, "standardDtype must be one of"),
    ("{broken", "not valid JSON"),
])
def test_bad_config_is_one_clear_error(tmp_path, obj, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write(tmp_path, obj))


@pytest.mark.parametrize("overrides,needle", [
    ({"backend.graph": "contrib"}, "shapes the standard graph only; graph contrib builds none"),
    ({"backend.backend": "numpy"}, "the numpy backend builds none"),
])
def test_a_standard_dtype_where_no_standard_graph_is_built_is_refused(overrides, needle):
    base = load_config(None)
    assert base.backend.standard_dtype == "float16"
    assert base.with_overrides(**{"backend.standard_dtype": "float32"}).backend.standard_dtype \
        == "float32"                                   # graph auto: standard on CANN
    with pytest.raises(ConfigError, match=needle):
        base.with_overrides(**{"backend.standard_dtype": "float32", **overrides})
    r = run_cli("--graph", "contrib", "--standard-dtype", "float32", "--no-tls", "--port", "0",
                "--model", "/nonexistent.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--standard-dtype" in r.stderr


def test_cli_bad_config_exits_with_one_line(tmp_path):
    r = run_cli("--config", write(tmp_path, {"ServerConfig": {"port": 1}}))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "port must be 0 or in 1024..65535" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--parallel-runs", "x"], "argument --parallel-runs: invalid int value: 'x'"),
    (["--port"], "argument --port: expected one argument"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_cli_bad_flag_is_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and needle in r.stderr and "--help" in r.stderr
    assert "usage:" not in r.stderr


def test_cli_missing_config_file(tmp_path):
    r = run_cli("--config", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "cannot read config file" in r.stderr


def test_cli_missing_model_file(tmp_path):
    r = run_cli("--model", str(tmp_path / "missing.gguf"), "--no-tls", "--port", "0",
                env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip() == ("tiny_mindie: error: model file not found: "
                                f"{tmp_path / 'missing.gguf'}")


def test_cli_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really" * 10)
    r = run_cli("--model", str(bad), "--no-tls", "--port", "0",
                env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "not a readable GGUF file" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_unknown_registry_name(tmp_path):
    r = run_cli("--model", "gpt-17", "--no-tls", "--port", "0",
                env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "unknown model 'gpt-17'" in r.stderr


def test_cli_port_in_use_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("--port", str(port), "--no-tls", env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_cli_help_and_list_models():
    r = run_cli("--help")
    assert r.returncode == 0 and "serve" in r.stdout and "pull" in r.stdout
    r = run_cli("serve", "--help")
    assert r.returncode == 0 and "--no-tls" in r.stdout and "--backend" in r.stdout
    r = run_cli("list-models")
    assert (r.returncode == 0 and "smollm2-135m-instruct (default)" in r.stdout
            and "Apache-2.0" in r.stdout)
    for name in ("gemma3-270m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        assert f"\n{name}\n" in r.stdout, r.stdout


def test_config_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xff\xfe{}")
    r = run_cli("--config", str(p))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr


def test_model_config_must_be_a_list(tmp_path):
    with pytest.raises(ConfigError, match="ModelConfig must be a list"):
        load_config(write(tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": {}}}}))


def test_a_named_but_missing_certificate_is_an_error_not_a_new_ca(tmp_path):
    typo = tmp_path / "typo" / "server.pem"
    r = run_cli("--config", write(tmp_path, {"ServerConfig": {"tlsCert": str(typo), "port": 0}}))
    assert r.returncode == 2
    assert "TLS file not found" in r.stderr and "Traceback" not in r.stderr
    assert not typo.exists() and not (tmp_path / "security").exists()


@pytest.mark.parametrize("ports,expected", [
    ({"port": 1030}, (18024, 18024, 18024)),                                   # all share
    ({"port": 1030, "managementPort": 1031, "metricsPort": 1030}, (18024, 1031, 18024)),
    ({}, (18024, 18024, 18024)),
])
def test_port_flag_moves_the_planes_that_share_the_business_listener(tmp_path, ports, expected):
    from tiny_mindie.cli.main import _config_from_args, build_parser
    args = build_parser().parse_args(["serve", "--config", write(tmp_path, {"ServerConfig": ports}),
                                      "--port", "18024"])
    s = _config_from_args(args).server
    assert (s.port, s.management_port, s.metrics_port) == expected


def test_prefix_caching_is_on_unless_the_file_or_the_flag_turns_it_off(tmp_path):
    from tiny_mindie.cli.main import _config_from_args, build_parser
    assert load_config(write(tmp_path, {})).backend.schedule.prefix_caching is True
    off = write(tmp_path, {"BackendConfig": {"ScheduleConfig": {"prefixCaching": False}}})
    assert load_config(off).backend.schedule.prefix_caching is False
    args = build_parser().parse_args(["serve", "--no-prefix-cache"])
    assert _config_from_args(args).backend.schedule.prefix_caching is False


def test_speculation_is_on_unless_the_file_the_flag_or_the_environment_turns_it_off(tmp_path):
    from tiny_mindie.cli.main import _config_from_args, build_parser
    assert load_config(write(tmp_path, {})).backend.schedule.speculative_decoding is True
    off = write(tmp_path, {"BackendConfig": {"ScheduleConfig": {"speculativeDecoding": False}}})
    assert load_config(off).backend.schedule.speculative_decoding is False
    bad = write(tmp_path, {"BackendConfig": {"ScheduleConfig": {"speculativeDecoding": "no"}}})
    with pytest.raises(ConfigError, match="speculativeDecoding must be true or false"):
        load_config(bad)
    args = build_parser().parse_args(["serve"])
    assert _config_from_args(args).backend.schedule.speculative_decoding is True
    args = build_parser().parse_args(["serve", "--no-speculation"])
    assert _config_from_args(args).backend.schedule.speculative_decoding is False
    off = write(tmp_path, {"BackendConfig": {"ScheduleConfig": {"speculativeDecoding": False}}})
    args = build_parser().parse_args(["serve", "--config", off, "--speculation"])
    assert _config_from_args(args).backend.schedule.speculative_decoding is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculation", "--no-speculation"])
    from tiny_mindie.config.env import EnvError, apply_env

    def with_env(environ, argv=()):
        parser = build_parser()
        apply_env(parser, ["serve"], environ)
        return _config_from_args(parser.parse_args(["serve", *argv])).backend.schedule
    assert with_env({"TINY_MINDIE_NO_SPECULATION": "1"}).speculative_decoding is False
    assert with_env({"TINY_MINDIE_NO_SPECULATION": "0"}).speculative_decoding is True
    # the flag wins over the variable, either way round
    assert with_env({"TINY_MINDIE_NO_SPECULATION": "1"},
                    ["--speculation"]).speculative_decoding is True
    assert with_env({"TINY_MINDIE_SPECULATION": "1"},
                    ["--no-speculation"]).speculative_decoding is False
    assert with_env({"TINY_MINDIE_SPECULATION": "1",
                     "TINY_MINDIE_NO_SPECULATION": "0"}).speculative_decoding is True
    with pytest.raises(EnvError, match="TINY_MINDIE_SPECULATION and TINY_MINDIE_NO_SPECULATION "
                                       "contradict each other"):
        with_env({"TINY_MINDIE_SPECULATION": "1", "TINY_MINDIE_NO_SPECULATION": "yes"})


def test_registry_alias_shows_the_full_model_name(tmp_path):
    from tiny_mindie.cli.main import _config_from_args, build_parser
    args = build_parser().parse_args(["serve", "--model", "smollm2"])
    assert _config_from_args(args).backend.model.model_name == "smollm2-135m-instruct"


def test_engine_types_reject_out_of_range_values():
    from tiny_mindie.engine.request import GenerationRequest, SamplingParams, StopCriteria
    for bad in ({"temperature": 0}, {"top_p": 1.5}, {"typical_p": 0}, {"top_k": -1},
                {"repetition_penalty": 0}, {"seed": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError):
        StopCriteria(max_new_tokens=0)
    with pytest.raises(ValueError):
        GenerationRequest(prompt_ids=[1], priority=0)


def test_serving_an_unsupported_architecture_is_one_line(tmp_path):
    import gguf
    bad = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(bad), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_cli("--model", str(bad), "--no-tls", "--port", "0",
                env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "architecture 'mamba' is not supported" in r.stderr, r.stderr


def test_execution_providers_from_the_config(tmp_path):
    cfg = load_config(write(tmp_path, {"BackendConfig": {"executionProviders": [
        "CPUExecutionProvider", ["CANNExecutionProvider", {"device_id": "1"}]]}}))
    assert cfg.backend.execution_providers == ("CPUExecutionProvider",
                                               ("CANNExecutionProvider", {"device_id": "1"}))
    with pytest.raises(ConfigError, match="executionProviders"):
        load_config(write(tmp_path, {"BackendConfig": {"executionProviders": "CPU"}}))


# ---- start-up errors of the TLS files, the listen address and numbers -------------------------

def default_tls_set(home):
    """A first run's TLS files (CA and its key, server and client pairs, empty CRL) in
    ``home``/security, where a config file in ``home`` finds them by default."""
    from dataclasses import replace as dc_replace

    from tiny_mindie.config.tls import tls_files
    from tiny_mindie.server.tls import make_certificates
    files = tls_files(dc_replace(load_config(None), home=str(home)))
    make_certificates(files)
    return files


def serve_until_model(tmp_path, server_config: dict, *args):
    """Run the server on a config in ``tmp_path`` and a model file that does not exist: TLS is
    checked before the model is loaded, so a run that gets past TLS stops at the model."""
    return run_cli("--config", write(tmp_path, {"ServerConfig": {"port": 0, **server_config}}),
                   "--model", str(tmp_path / "no-model.gguf"), *args)


def assert_one_line_error(r, expected: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.strip() == f"tiny_mindie: error: {expected}"


def test_first_run_keeps_the_ca_key_and_makes_an_empty_crl(tmp_path):
    from tiny_mindie.server.tls import check_crls
    r = run_cli("--port", "0", "--model", str(tmp_path / "no-model.gguf"),
                env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "model file not found" in r.stderr
    assert ("created a CA and its key, a server and a client certificate and an empty CRL in"
            in r.stdout)
    sec = tmp_path / "security"
    assert (sec / "ca" / "ca.key.pem").stat().st_mode & 0o777 == 0o600
    from cryptography import x509
    ca = x509.load_pem_x509_certificate((sec / "ca" / "ca.pem").read_bytes())
    assert check_crls(str(sec / "certs" / "server_crl.pem"), [ca]) == []  # issuer, signature, dates


def test_a_named_crl_that_is_missing_is_an_error(tmp_path):
    default_tls_set(tmp_path)
    r = serve_until_model(tmp_path, {"tlsCrlFiles": ["typo_crl.pem"]})
    assert_one_line_error(r, f"TLS CRL file not found: {tmp_path}/security/certs/typo_crl.pem "
                             f"(fix tlsCrlPath / tlsCrlFiles, make one with python -m tiny_mindie "
                             f"certs --crl, or set \"tlsCrlFiles\": [] to check no CRL)")


def test_no_crl_when_none_is_named(tmp_path):
    default_tls_set(tmp_path)
    r = serve_until_model(tmp_path, {"tlsCrlFiles": []})
    assert r.returncode == 2 and "model file not found" in r.stderr     # TLS passed


def test_crl_signed_by_another_key_is_an_error(tmp_path):
    files = default_tls_set(tmp_path)
    other = default_tls_set(tmp_path / "other")      # the same CA name, another key
    os.replace(other.crls[0], files.crls[0])
    r = serve_until_model(tmp_path, {})
    assert_one_line_error(r, f"TLS CRL file {files.crls[0]} is not signed by the CA "
                             f"CN=tiny_mindie CA,O=tiny_mindie (its signature does not verify with "
                             f"the CA's key)")


def test_crl_of_another_ca_is_an_error(tmp_path):
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    files = default_tls_set(tmp_path)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    crl = (x509.CertificateRevocationListBuilder()
           .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Someone Else CA")]))
           .last_update(now).next_update(now + dt.timedelta(days=1)).sign(key, hashes.SHA256()))
    from cryptography.hazmat.primitives.serialization import Encoding
    with open(files.crls[0], "wb") as fh:
        fh.write(crl.public_bytes(Encoding.PEM))
    r = serve_until_model(tmp_path, {})
    assert_one_line_error(r, f"TLS CRL file {files.crls[0]} is issued by CN=Someone Else CA, "
                             f"which is not a CA of tlsCaFile")


def test_expired_crl_is_a_loud_warning(tmp_path):
    import datetime as dt

    from tiny_mindie.server.tls import issue_crl
    files = default_tls_set(tmp_path)
    issue_crl(files.crls[0], files.ca[0], files.ca_key,
              last_update=dt.datetime(2025, 12, 1, tzinfo=dt.UTC),
              next_update=dt.datetime(2026, 1, 2, 3, 4, tzinfo=dt.UTC))
    r = serve_until_model(tmp_path, {})
    assert r.returncode == 2 and "model file not found" in r.stderr     # it starts
    assert (f"WARNING tiny_mindie.tls: TLS CRL file {files.crls[0]} expired on 2026-01-02 03:04 "
            f"UTC: EVERY client certificate of CN=tiny_mindie CA,O=tiny_mindie will be refused") \
        in r.stderr


def _drop_file_access_override() -> None:
    """preexec_fn: take CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH out of the bounding set, so
    that root, after exec, is refused a file of mode 000 like anyone else."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):   # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:   # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_certificate_is_named(tmp_path):
    files = default_tls_set(tmp_path)
    os.chmod(files.cert, 0)
    preexec = None
    if os.geteuid() == 0:   # root reads a mode-000 file unless it drops its override capability
        preexec = _drop_file_access_override
        try:
            probe = subprocess.run([sys.executable, "-c", f"open({files.cert!r}).read()"],
                                   preexec_fn=preexec, capture_output=True, timeout=30)
        except subprocess.SubprocessError as exc:
            pytest.skip(f"running as root and cannot drop CAP_DAC_OVERRIDE: {exc}")
        if probe.returncode == 0:
            pytest.skip("running as root and a mode-000 file is still readable without "
                        "CAP_DAC_OVERRIDE")
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "--config",
                        write(tmp_path, {"ServerConfig": {"port": 0}}),
                        "--model", str(tmp_path / "no-model.gguf")],
                       capture_output=True, text=True, timeout=60, preexec_fn=preexec)
    assert_one_line_error(r, f"cannot read TLS certificate {files.cert}: Permission denied")


@pytest.mark.parametrize("key,value,expected", [
    ("tlsCert", "security/certs",
     "cannot read TLS certificate {home}/security/certs: Is a directory"),
    ("tlsCaFile", ["sub"], "cannot read TLS CA file {home}/security/ca/sub: Is a directory"),
    ("tlsPk", "security/certs/server.pem",
     "TLS private key {home}/security/certs/server.pem is not a PEM private key"),
    ("tlsCert", "garbage.pem",
     "TLS certificate {home}/garbage.pem is not a PEM certificate "
     "(no valid -----BEGIN CERTIFICATE----- block)"),
    ("tlsCrlFiles", ["../../garbage.pem"],
     "TLS CRL file {home}/garbage.pem is not a PEM CRL (no -----BEGIN X509 CRL----- block)"),
    ("tlsPk", "other/security/keys/server.key.pem",
     "cannot load TLS certificate {home}/security/certs/server.pem with key "
     "{home}/other/security/keys/server.key.pem: key values mismatch"),
])
def test_bad_tls_file_is_named_with_what_is_wrong(tmp_path, key, value, expected):
    default_tls_set(tmp_path)
    default_tls_set(tmp_path / "other")
    (tmp_path / "security" / "ca" / "sub").mkdir()
    (tmp_path / "garbage.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n")
    r = serve_until_model(tmp_path, {key: value})
    assert_one_line_error(r, expected.format(home=tmp_path))
    assert "Traceback" not in r.stderr


def test_unresolvable_listen_address_is_named(tmp_path):
    r = run_cli("--host", "no.such.host.invalid", "--port", "0", "--no-tls",
                env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("tiny_mindie: error: cannot listen on no.such.host.invalid:0: the "
                               "address 'no.such.host.invalid' cannot be resolved (")


@pytest.mark.parametrize("raw,key", [
    ('{"ServerConfig": {"tokenTimeout": NaN}}', "ServerConfig.tokenTimeout"),
    ('{"ServerConfig": {"e2eTimeout": Infinity}}', "ServerConfig.e2eTimeout"),
    ('{"ServerConfig": {"tlsHandshakeTimeout": -Infinity}}', "ServerConfig.tlsHandshakeTimeout"),
    ('{"ServerConfig": {"tokenTimeout": 1e999}}', "ServerConfig.tokenTimeout"),
    ('{"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"x": [1, NaN]}]}}}',
     "BackendConfig.ModelDeployConfig.ModelConfig[0].x[1]"),
])
def test_non_finite_numbers_are_rejected_with_their_key(tmp_path, raw, key):
    with pytest.raises(ConfigError,
                       match=rf"^{re.escape(key)} must be a finite number, got -?(nan|inf)$"):
        load_config(write(tmp_path, raw))


def test_cli_nan_timeout_is_one_line(tmp_path):
    r = run_cli("--config", write(tmp_path, '{"ServerConfig": {"tokenTimeout": NaN}}'))
    assert_one_line_error(r, "ServerConfig.tokenTimeout must be a finite number, got nan")


@pytest.mark.parametrize("seconds", [0, -1, 1e-9, 0.09, 601])
def test_handshake_timeout_has_a_range(tmp_path, seconds):
    with pytest.raises(ConfigError, match=r"^ServerConfig.tlsHandshakeTimeout must be in "
                                          r"0.1..600 seconds, got "):
        load_config(write(tmp_path, {"ServerConfig": {"tlsHandshakeTimeout": seconds}}))
    assert load_config(write(tmp_path, {"ServerConfig": {"tlsHandshakeTimeout": 2}})) \
        .server.tls_handshake_timeout == 2.0
    assert load_config(write(tmp_path, {"ServerConfig": {"tlsHandshakeTimeout": 0.1}})) \
        .server.tls_handshake_timeout == 0.1
    assert load_config(None).server.tls_handshake_timeout == 10.0


def nested(dotted: str, value) -> dict:
    """``{"A": {"B": {"c": value}}}`` for ``"A.B.c"``."""
    obj: dict = {}
    *parents, key = dotted.split(".")
    inner = obj
    for p in parents:
        inner = inner.setdefault(p, {})
    inner[key] = value
    return obj


def test_every_numeric_key_has_a_range():
    """Each int / float field of the config dataclasses is in RANGES, or checked by hand."""
    import dataclasses

    from tiny_mindie.config import load as C
    by_hand = {"server.port", "server.management_port", "server.metrics_port",
               "server.health_port"}
    ranged = {attr for _, attr, *_ in C.RANGES}
    for prefix, cls in (("server", C.ServerConfig), ("backend", C.BackendConfig),
                        ("backend.model", C.ModelDeployConfig),
                        ("backend.schedule", C.ScheduleConfig)):
        for f in dataclasses.fields(cls):
            if f.type in ("int", "float"):
                assert f"{prefix}.{f.name}" in ranged | by_hand, f"{prefix}.{f.name} has no range"


def _range_cases():
    from tiny_mindie.config.load import RANGES, show
    for name, _attr, lo, hi, unit in RANGES:
        is_float = isinstance(lo, float)
        below = (lo / 2 if lo else -1.0) if is_float else lo - 1
        huge = "1e+30" if is_float else "an integer of 31 digits"
        for bad, got in ((below, show(float(below) if is_float else below)),
                         (hi + 1, show(float(hi + 1) if is_float else hi + 1)), (10 ** 30, huge)):
            yield pytest.param(name, bad, f"{name} must be in {show(lo)}..{show(hi)}{unit}, "
                                          f"got {got}", id=f"{name.rsplit('.', 1)[1]}={bad:g}")
    for key in ("port", "managementPort", "metricsPort", "healthPort"):
        for bad in (-1, 1, 1023, 65536):
            yield pytest.param(f"ServerConfig.{key}", bad,
                               f"ServerConfig.{key} must be 0 or in 1024..65535, got {bad}",
                               id=f"{key}={bad}")


@pytest.mark.parametrize("name,bad,message", list(_range_cases()))
def test_numbers_out_of_range_are_one_line_naming_the_key_and_range(tmp_path, name, bad, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, nested(name, bad)))
    assert str(err.value) == message


def test_range_limits_themselves_are_accepted(tmp_path):
    from tiny_mindie.config.load import RANGES
    # a base where the cross-key rules hold at every limit
    base = load_config(None).with_overrides(**{"model.max_input_token_len": 1,
                                               "schedule.max_prefill_batch_size": 1})
    for _name, attr, lo, hi, _unit in RANGES:
        part, _, field = attr.partition(".")
        if part == "backend" and "." in field:
            part, field = field.split(".")
        for v in (lo, hi):
            extra = {"schedule.max_batch_size": v} if field == "max_prefill_batch_size" else {}
            cfg = base.with_overrides(**{f"{part}.{field}": v}, **extra)
            assert cfg is not None
    assert load_config(None).with_overrides(**{"backend.npu_device_ids": (1023,)})
    with pytest.raises(ConfigError, match=r"^BackendConfig.npuDeviceIds must hold device ids in "
                                          r"0..1023, got 1024$"):
        load_config(write(tmp_path, {"BackendConfig": {"npuDeviceIds": [[1024]]}}))


def test_cache_block_size_zero_is_refused_at_start(tmp_path):
    """Was accepted; GET /v1/status then answered 500 (ZeroDivisionError)."""
    r = run_cli("--config", write(tmp_path, {"BackendConfig": {"ScheduleConfig": {
        "cacheBlockSize": 0}}}))
    assert_one_line_error(r, "BackendConfig.ScheduleConfig.cacheBlockSize must be in 1..4096 "
                             "tokens, got 0")


def test_huge_integer_for_a_float_key_is_one_line(tmp_path):
    """Was: OverflowError traceback, exit 1."""
    r = run_cli("--config",
                write(tmp_path, '{"ServerConfig": {"tokenTimeout": 1%s}}' % ("0" * 400)))
    assert_one_line_error(r, "ServerConfig.tokenTimeout must be a finite number, got an integer "
                             "of 401 digits")


def test_a_number_of_5000_digits_is_one_line_with_its_position(tmp_path):
    """Was: ValueError (Exceeds the limit (4300 digits)) traceback out of json.load, exit 1."""
    path = write(tmp_path, '{"ServerConfig": {\n  "port": %s}}' % ("9" * 5000))
    r = run_cli("--config", path)
    assert_one_line_error(r, f"config file {path} is not valid: a number of 5000 digits at line 2 "
                             f"column 11 (char 29); numbers may have at most 4300 digits")


@pytest.mark.parametrize("host,shown", [
    ("a..b", '"a..b"'), ("\ud800", '"\\ud800"'), ("127.0.0.1\u0000x", '"127.0.0.1\\u0000x"'),
    ("-host", '"-host"'), ("h_st", '"h_st"'), ("1.2.3", '"1.2.3"'), ("999.1.1.1", '"999.1.1.1"'),
    ("a b", '"a b"'), ("x" * 64, '"' + "x" * 64 + '"'), ("ünï.com", '"\\u00fcn\\u00ef.com"'),
])
@pytest.mark.parametrize("key", ["ipAddress", "managementIpAddress"])
def test_listen_address_must_be_an_ip_or_a_host_name(tmp_path, key, host, shown):
    """Was: UnicodeError (idna) traceback for "a..b" / "\ud800", a NUL accepted."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, {"ServerConfig": {key: host}}))
    assert str(err.value) == (f"ServerConfig.{key} must be an IP address or a host name (letters, "
                              f"digits, hyphens and dots), got {shown}"[:200])


def test_cli_bad_listen_address_is_one_line(tmp_path):
    r = run_cli("--config", write(tmp_path, {"ServerConfig": {"ipAddress": "a..b"}}))
    assert_one_line_error(r, 'ServerConfig.ipAddress must be an IP address or a host name '
                             '(letters, digits, hyphens and dots), got "a..b"')
    r = run_cli("--host", "a..b", env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "ServerConfig.ipAddress must be an IP address" in r.stderr


def test_empty_listen_address_says_to_use_0000(tmp_path):
    """Was: "" bound 0.0.0.0 and [::] while the banner said 127.0.0.1."""
    with pytest.raises(ConfigError, match=r"^ServerConfig.ipAddress must not be empty \(MindIE "
                                          r"requires an address; use 0.0.0.0 to listen on every "
                                          r"address\)$"):
        load_config(write(tmp_path, {"ServerConfig": {"ipAddress": ""}}))


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%eth0", "localhost",
                                  "my-host.example.com", "example.com.", "a" * 63 + ".b"])
def test_good_listen_addresses_are_accepted(tmp_path, host):
    cfg = load_config(write(tmp_path, {"ServerConfig": {"ipAddress": host}}))
    assert cfg.server.ip_address == host


@pytest.mark.parametrize("crls", [[], ["server_crl.pem"], ["missing_crl.pem"]])
def test_empty_ca_file_list_is_a_config_error_before_the_model_loads(tmp_path, crls):
    """Was: IndexError at files.ca[0] after the model loaded (or in TLSFiles.ca_key), or a
    misleading message about the CRL."""
    default_tls_set(tmp_path)
    r = serve_until_model(tmp_path, {"tlsCaFile": [], "tlsCrlFiles": crls})
    assert_one_line_error(r, "ServerConfig.tlsCaFile must name at least one CA file (mutual TLS "
                             "checks client certificates against it; or use --no-tls)")
    r = serve_until_model(tmp_path, {"tlsCaFile": [], "tlsCrlFiles": crls}, "--no-tls")
    assert r.returncode == 2 and "model file not found" in r.stderr      # no TLS: no CA needed


def test_certs_issues_a_client_and_revokes_it(tmp_path):
    from cryptography import x509
    script = [sys.executable, "-m", "tiny_mindie", "certs", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def make(*args):
        return subprocess.run([*script, *args], capture_output=True, text=True, timeout=60, env=env)

    assert make().returncode == 0
    sec = tmp_path / "security"
    assert make("--client", "alice").returncode == 0
    alice = x509.load_pem_x509_certificate((sec / "certs" / "alice.pem").read_bytes())
    r = make("--revoke", str(sec / "certs" / "alice.pem"))
    assert r.returncode == 0 and "(1 revoked; restart the server to apply it)" in r.stdout
    r = make("--crl")                                  # re-signed, the entry kept
    assert r.returncode == 0 and "(1 revoked;" in r.stdout
    crl = x509.load_pem_x509_crl((sec / "certs" / "server_crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(alice.serial_number) is not None
    assert len(crl) == 1
    other = tmp_path / "other"
    assert subprocess.run([*script[:-1], str(other)], capture_output=True, env=env).returncode == 0
    r = make("--revoke", str(other / "security" / "certs" / "client.pem"))   # another CA's
    assert r.returncode == 2 and "was not issued by the CA" in r.stderr


def test_certs_with_config_writes_the_files_the_server_reads(tmp_path):
    """Was: --config unknown; --revoke wrote DIR/security/certs/server_crl.pem whatever the
    server's tlsCrlPath / tlsCrlFiles named."""
    from cryptography import x509

    from tiny_mindie.config.tls import tls_files
    from tiny_mindie.server.tls import server_context
    script = [sys.executable, "-m", "tiny_mindie", "certs"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "TINY_MINDIE_HOME": str(tmp_path / "home")}
    server = {"port": 0, "ipAddress": "127.0.0.2", "tlsCaPath": "pki/ca", "tlsCaFile": ["root.pem"],
              "tlsCert": "pki/srv.pem", "tlsPk": "pki/keys/srv.key",
              "tlsCrlPath": "pki/crl", "tlsCrlFiles": ["revoked.pem"]}
    path = write(tmp_path, {"ServerConfig": server})

    def make(*args):
        return subprocess.run([*script, "--config", path, *args], capture_output=True, text=True,
                              timeout=60, env=env)

    r = make()
    assert r.returncode == 0, r.stderr
    pki = tmp_path / "pki"
    for f in ("ca/root.pem", "ca/ca.key.pem", "srv.pem", "keys/srv.key", "crl/revoked.pem",
              "client.pem", "keys/client.key.pem"):
        assert (pki / f).is_file(), f
    assert not (tmp_path / "home").exists() and not (tmp_path / "security").exists()
    srv = x509.load_pem_x509_certificate((pki / "srv.pem").read_bytes())
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.2" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert make("--client", "alice").returncode == 0
    alice = x509.load_pem_x509_certificate((pki / "alice.pem").read_bytes())
    r = make("--revoke", str(pki / "alice.pem"))
    assert r.returncode == 0 and f"{pki}/crl/revoked.pem (1 revoked;" in r.stdout, r.stdout
    crl = x509.load_pem_x509_crl((pki / "crl" / "revoked.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(alice.serial_number) is not None
    server_context(tls_files(load_config(path)))           # the server takes these files
    r = serve_until_model(tmp_path, server)
    assert r.returncode == 2 and "model file not found" in r.stderr, r.stderr   # TLS passed
    # a config that names no CRL: nothing to revoke into
    no_crl = write(tmp_path, {"ServerConfig": {**server, "tlsCrlFiles": []}})
    r = subprocess.run([*script, "--config", no_crl, "--revoke", str(pki / "alice.pem")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "names no CRL" in r.stderr
    r = subprocess.run([*script, "--config", str(tmp_path / "missing.json")], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stderr.startswith("tiny_mindie: error: cannot read config file")


def test_banner_shows_the_addresses_a_host_name_is_bound_to():
    """A host name resolves to addresses: the banner names them; a wildcard address is shown as it
    is (was: 0.0.0.0 shown as 127.0.0.1), and the try-it URL uses the loopback address."""
    from types import SimpleNamespace

    from tiny_mindie.config.load import load_config
    from tiny_mindie.server.listen import Listener, bind
    from tiny_mindie.service.lifecycle import banner

    socks = []
    try:
        for host, extra in (("localhost", "  bound to 127.0.0.1:{p}"), ("0.0.0.0", ""),
                            ("127.0.0.1", "")):
            lsocks = bind(host, 0, 1)
            socks += lsocks
            port = lsocks[0].getsockname()[1]
            lst = Listener(host, 0, frozenset({"business"}), SimpleNamespace(sockets=lsocks))
            cfg = load_config(None).with_overrides(**{"server.ip_address": host})
            backend = SimpleNamespace(num_slots=1, max_seq_len=8, name="numpy", device="cpu")
            llm = SimpleNamespace(model_name="m", model_path="/m.gguf", backend=backend,
                                  config=SimpleNamespace(architecture="llama"), draft=None)
            text = banner(cfg, llm, [lst], None, 0.1)
            line = next(ln for ln in text.splitlines() if "listens" in ln)
            bound = ", ".join(f"[{s.getsockname()[0]}]:{port}" if ":" in s.getsockname()[0]
                              else f"{s.getsockname()[0]}:{port}" for s in lsocks)
            want = f"  listens  http://{host}:{port}  (business)"
            assert line == (want if not extra else f"{want}  bound to {bound}"), line
            reach = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
            assert f"http://{host if host == 'localhost' else reach}:{port}/infer" in text
    finally:
        for s in socks:
            s.close()


# ---- the settings table (tiny_mindie/config/settings.py) --------------------------------------

def test_the_committed_configuration_reference_is_the_generated_one():
    """docs/configuration.md is made by ``python scripts/configuration_doc.py``."""
    from script_modules import load_script

    from tiny_mindie.cli.main import serve_parser
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    doc = load_script("configuration_doc")
    with open(os.path.join(root, "docs", "configuration.md"), encoding="utf-8") as fh:
        committed = fh.read()
    assert committed == doc.markdown(serve_parser()), \
        "run: python scripts/configuration_doc.py > docs/configuration.md"


def test_each_setting_has_one_key_one_field_and_its_own_flags():
    import dataclasses

    from tiny_mindie.config import load as C
    from tiny_mindie.config.settings import SETTINGS
    assert len({s.key for s in SETTINGS}) == len({s.attr for s in SETTINGS}) == len(SETTINGS)
    flags = [f.name for s in SETTINGS for f in s.flags]
    assert len(flags) == len(set(flags))
    cfg = load_config(None)
    for s in SETTINGS:
        assert cfg.value(s) == s.default, s.attr
        assert s.name in {f.name for f in dataclasses.fields(
            {"server": C.ServerConfig, "backend": C.BackendConfig, "model": C.ModelDeployConfig,
             "schedule": C.ScheduleConfig}[s.group])}


def test_the_settings_passed_to_the_llm_are_its_keywords():
    """Each ``llm`` name of the table is a keyword of LLM; every keyword is fed by the table or
    derived in lifecycle.load_llm."""
    from tiny_mindie.config.settings import SETTINGS
    from tiny_mindie.llm import KEYWORDS
    params = {"model", "log", *KEYWORDS}
    fed = {s.llm for s in SETTINGS if s.llm}
    derived = {"model", "max_input_len", "device_id", "providers", "schedule", "log", "num_slots"}
    assert fed <= params and params == fed | derived


def test_the_llm_keywords_fill_one_options_value_and_one_limits_value():
    from tiny_mindie.engine.engine import EngineLimits
    from tiny_mindie.llm import LLM, resolve_settings
    from tiny_mindie.model.options import BackendOptions

    options, limits, own = resolve_settings({"threads": 3, "speculation": False,
                                             "max_seq_len": 100, "num_slots": 2})
    assert options == BackendOptions(threads=3, speculation=False)
    assert limits == EngineLimits(max_seq_len=100, speculation=False)
    assert own["num_slots"] == 2 and own["draft_model"] is None
    given = BackendOptions(weights="compact")
    assert resolve_settings({}, given)[0] is given
    assert resolve_settings({"threads": 1}, given)[0] == BackendOptions(weights="compact",
                                                                        threads=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'thread'"):
        LLM("no-such-model", thread=2)                   # refused before any pull
    with pytest.raises(TypeError, match="arguments 'a', 'b'"):
        resolve_settings({"b": 1, "a": 2})


def test_flags_imply_their_companions_and_a_flag_of_its_own_wins(tmp_path):
    from tiny_mindie.cli.main import _config_from_args, build_parser

    def cfg(*argv):
        return _config_from_args(build_parser().parse_args(["serve", *argv]))

    s = cfg("--host", "0.0.0.0").server
    assert (s.ip_address, s.management_ip_address) == ("0.0.0.0", "0.0.0.0")
    m = cfg("--max-seq-len", "100").backend.model
    assert (m.max_seq_len, m.max_input_token_len) == (100, 99)
    assert cfg("--model", "/x/my-model.gguf").backend.model.model_name == "my-model"
    assert cfg("--model", "/x/my-model.gguf", "--model-name", "m").backend.model.model_name == "m"
    s = cfg("--port", "2000", "--metrics-port", "2001").server
    assert (s.port, s.management_port, s.metrics_port) == (2000, 2000, 2001)
    named = write(tmp_path, {"BackendConfig": {"ModelDeployConfig": {
        "ModelConfig": [{"modelName": "file-name"}]}}})
    assert cfg("--config", named, "--model", "/x/y.gguf").backend.model.model_name == "file-name"
    b = cfg("--no-tls", "--no-prefix-cache", "--backend", "numpy", "--threads", "3")
    assert not b.server.https_enabled and not b.backend.schedule.prefix_caching
    assert (b.backend.backend, b.backend.intra_op_threads) == ("numpy", 3)


@pytest.mark.parametrize("depth", [990, 100_000])
def test_a_deeply_nested_config_file_is_one_line(tmp_path, depth):
    """Python's json (and a recursive walk of what it read) stop at the recursion limit."""
    path = write(tmp_path, '{"x": %s%s}' % ("[" * depth, "]" * depth))
    r = run_cli("--config", path)
    assert_one_line_error(r, f"config file {path} is not valid: arrays or objects nested "
                             "too deep")


def test_an_embedding_model_alone_or_beside_the_chat_model(tmp_path):
    """``--embedding-model`` alone serves no chat model; with ``--model`` or a config file the
    chat model stays; an empty model without an embedding model names the flag."""
    from tiny_mindie.cli.main import _config_from_args, build_parser

    def cfg(*argv):
        return _config_from_args(build_parser().parse_args(["serve", *argv])).backend.model

    alone = cfg("--embedding-model", "all-minilm-l6-v2")
    assert (alone.model_weight_path, alone.embedding_model) == ("", "all-minilm-l6-v2")
    assert cfg("--embedding-model", "e", "--model", "gemma3-270m").model_weight_path == \
        "gemma3-270m"
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert cfg("--config", str(path), "--embedding-model", "e").model_weight_path == \
        "smollm2-135m-instruct"
    with pytest.raises(ConfigError, match="^--model: .*modelWeightPath must name a model"):
        cfg("--model", "")


def test_the_embedding_model_variable_is_read(tmp_path):
    r = run_cli("serve", "--no-tls", "--port", "0",
                env={"TINY_MINDIE_HOME": str(tmp_path),
                     "TINY_MINDIE_EMBEDDING_MODEL": str(tmp_path / "none.gguf")})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "embedding model: model file not found" in r.stderr
