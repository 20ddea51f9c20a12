"""specdec/service_config.py: each role's config from its flags and the environment, in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec import service_config
from specdec.cli import build_parser
from specdec.service_config import DrafterConfig, GatewayConfig, VerifierConfig

ROOT = Path(__file__).resolve().parents[1]


def config(argv: list[str], environ: dict[str, str]):
    return service_config.service_config(build_parser().parse_args(["serve", *argv]), environ)


def test_each_role_gets_its_own_config_type():
    assert type(config(["verifier", "--device", "cpu"], {})) is VerifierConfig
    assert type(config(["drafter", "--device", "cpu"], {})) is DrafterConfig
    assert type(config(["gateway", "--verifier", "v:1"], {})) is GatewayConfig


def test_a_variable_fills_in_for_its_flag_and_the_flag_wins(tmp_path):
    environ = {"SPECDEC_HOST": "0.0.0.0", "SPECDEC_THREADS": "3", "SPECDEC_HEALTH_PORT": "8086",
               "SPECDEC_TRACE_DETAIL": "round", "SPECDEC_TLS_CERT": "env.crt", "SPECDEC_TLS_KEY": "env.key"}
    from_env = config(["verifier", "--device", "cpu"], environ)
    assert (from_env.serve.host, from_env.threads, from_env.serve.health_port, from_env.trace_detail) == \
        ("0.0.0.0", 3, 8086, "round")
    assert (str(from_env.serve.tls.cert), str(from_env.serve.tls.key)) == ("env.crt", "env.key")
    flags = ["verifier", "--device", "cpu", "--host", "::1", "--threads", "2", "--health-port", "9000",
             "--trace-detail", "request", "--tls-cert", "flag.crt"]
    from_flags = config(flags, environ)
    assert (from_flags.serve.host, from_flags.threads, from_flags.serve.health_port, from_flags.trace_detail) == \
        ("::1", 2, 9000, "request")
    assert (str(from_flags.serve.tls.cert), str(from_flags.serve.tls.key)) == ("flag.crt", "env.key")
    default = config(["verifier", "--device", "cpu"], {})
    assert (default.serve.host, default.threads, default.serve.health_port, default.trace_detail) == \
        ("127.0.0.1", None, None, "request")  # threads None: torch's default on a CPU


def test_the_gateway_takes_its_api_keys_and_presents_the_first_service_token(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nkey-from-file\n")
    environ = {"SPECDEC_API_KEYS_FILE": str(keys), "SPECDEC_API_KEYS": "a,b",
               "SPECDEC_SERVICE_TOKEN": "t" * 20 + "," + "u" * 20}
    gateway = config(["gateway", "--verifier", "v:1"], environ)
    assert gateway.serve.api_keys == (b"key-from-file", b"a", b"b")
    assert gateway.serve.outbound_service_token == "t" * 20 and gateway.serve.service_tokens == ()
    verifier = config(["verifier", "--device", "cpu"], environ)
    assert verifier.serve.service_tokens == (b"t" * 20, b"u" * 20) and verifier.serve.api_keys == ()


@pytest.mark.parametrize("argv, environ, named", [
    (["verifier"], {"SPECDEC_THREADS": "two"}, "$SPECDEC_THREADS"),
    (["verifier"], {"SPECDEC_HEALTH_PORT": "http"}, "$SPECDEC_HEALTH_PORT"),
    (["verifier"], {"SPECDEC_TRACE_DETAIL": "every"}, "$SPECDEC_TRACE_DETAIL"),
    (["verifier", "--max-batch-size", "0"], {}, "--max-batch-size"),
    (["drafter", "--max-sessions-per-peer", "0"], {}, "--max-sessions-per-peer"),
    (["gateway"], {}, "--verifier"),
])
def test_a_bad_value_is_refused_naming_its_flag_or_variable(argv, environ, named):
    with pytest.raises(SystemExit) as info:
        config([*argv, "--device", "cpu"] if argv[0] != "gateway" else argv, environ)
    assert named in str(info.value)


def test_every_variable_is_in_the_table_and_read_nowhere_else():
    """Each variable is named once: in this module, and its docstring's table lists it."""
    names = {value for name, value in vars(service_config).items() if name.endswith("_ENV")}
    assert len(names) >= 15
    for variable in names:
        assert f"\n{variable} " in service_config.__doc__, variable
    sources = [path for folder in ("specdec", "gateway", "verifier_service", "drafter_service")
               for path in (ROOT / folder).rglob("*.py") if path.name != "service_config.py"]
    for path in sources:
        text = path.read_text()
        named = sorted(variable for variable in names if f'"{variable}"' in text)
        assert not named, f"{path.relative_to(ROOT)} names {named}"
