"""Finding 16: tokens and API keys must not travel in clear once engines are reachable off-host.

A CA and certificates made here (`cryptography`), then real processes on loopback: `dctl server`
over HTTPS, the CLI and the REST client trusting it through a CA file (and refusing it without
one, saying `--ca-file`), and `dctl agent` registering and heartbeating over HTTPS with its own
`/metrics` on HTTPS and an engine it serves over HTTPS and probes with the engine certificate.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from agent.control_plane import ControlPlaneLink
from agent.errors import ControlPlaneRejected, ControlPlaneUnavailable
from agent.instance_spec import InstanceSpec, engine_config
from agent.settings import SettingsError, load_agent_settings
from client.credentials import CredentialsFile, resolve
from client.http import ClientError, ControlPlaneClient
from protocol.engine_config import ServeConfigError, load_serve_config, validate_deployment_config
from protocol.rest import DeploymentCreate, Placement, TokenCreate
from protocol.wire import RegisterRequest
from runtime.tls import TlsError, check_key_file, check_name, check_server_files, client_context
from tests.cli.conftest import DCTL, Dctl, free_port, isolated_env
from tests.security.pki import Pki, make_pki

T = TypeVar("T")


# --- a small PKI ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- the checks, without a network ---------------------------------------------------------------


def test_a_key_every_user_can_read_is_refused_and_a_group_readable_one_warned(
    pki: Pki, tmp_path: Path
) -> None:
    key = tmp_path / "key.pem"
    key.write_bytes(pki.key.read_bytes())
    key.chmod(0o644)
    with pytest.raises(TlsError, match=r"accessible to every user.*chmod 600"):
        check_server_files(pki.cert, key)
    key.chmod(0o640)
    assert "readable by its group" in (check_key_file(key) or "")
    key.chmod(0o600)
    assert check_server_files(pki.cert, key) == []


def test_a_certificate_is_checked_for_the_name_clients_use(pki: Pki) -> None:
    check_name(pki.cert, pki.key, "127.0.0.1", pki.ca)
    check_name(pki.cert, pki.key, "localhost")  # trusting the certificate itself
    with pytest.raises(TlsError, match=r"not accepted for 10\.1\.2\.3"):
        check_name(pki.cert, pki.key, "10.1.2.3", pki.ca)
    with pytest.raises(TlsError, match=r"not accepted for 127\.0\.0\.1"):
        check_name(pki.cert, pki.key, "127.0.0.1", pki.other_ca)


def test_a_ca_file_that_is_missing_or_no_certificate_is_named(pki: Pki) -> None:
    with pytest.raises(TlsError, match=r"does-not-exist\.pem does not exist"):
        client_context(pki.ca.parent / "does-not-exist.pem")
    with pytest.raises(TlsError, match="holds no usable certificate"):
        client_context(pki.key)
    with pytest.raises(ClientError, match="DCTL_CA_FILE"):
        ControlPlaneClient("https://127.0.0.1:1", ca_file=pki.key)


def test_engine_tls_is_the_agents_to_decide_and_reaches_the_engine_config(
    pki: Pki, tmp_path: Path
) -> None:
    with pytest.raises(ServeConfigError, match=r"service\.tls_cert cannot be set"):
        validate_deployment_config({"service": {"tls_cert": str(pki.cert)}})
    plain = InstanceSpec(1, "web", "0" * 64, str(tmp_path), 18000)
    spec = InstanceSpec(1, "web", "0" * 64, str(tmp_path), 18000, tls_cert="/c", tls_key="/k")
    service = engine_config(spec)["service"]
    assert (service["tls_cert"], service["tls_key"]) == ("/c", "/k")
    assert "tls_cert" not in engine_config(plain)["service"]
    assert spec.fingerprint() != plain.fingerprint()  # turning TLS on replaces the engine
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ServeConfigError, match=r"service\.tls_cert and service\.tls_key go together"
    ):
        load_serve_config(None, {"model.path": str(tmp_path), "service.tls_key": str(pki.key)})
    served = load_serve_config(
        None,
        {"model.path": str(tmp_path), "service.tls_cert": str(pki.cert),
         "service.tls_key": str(pki.key)},
    )  # fmt: skip
    assert served.service.tls_cert == str(pki.cert)


def test_agent_tls_settings_come_in_pairs_and_are_checked(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no config file of the machine's
    for name in [n for n in os.environ if n.startswith("DCTL_")]:
        monkeypatch.delenv(name)
    half = load_agent_settings(engine_tls_cert=pki.cert)
    with pytest.raises(SettingsError, match=r"engine_tls_key .*engine_tls_cert is set: give both"):
        half.check_tls()
    bad_ca = load_agent_settings(ca_file=pki.key)
    with pytest.raises(SettingsError, match="invalid setting ca_file"):
        bad_ca.check_tls()
    both = load_agent_settings(metrics_tls_cert=pki.cert, metrics_tls_key=pki.key, ca_file=pki.ca)
    assert both.check_tls() == []


def test_a_context_keeps_its_ca_file_and_the_env_overrides_it(pki: Pki, tmp_path: Path) -> None:
    store = CredentialsFile(tmp_path / "credentials")
    store.add("https://cp:8700", "dctl_t", name="tls", ca_file=str(pki.ca))
    assert resolve(path=store.path, env={}).ca_file == str(pki.ca)
    other = {"DCTL_CA_FILE": str(pki.other_ca)}
    assert resolve(path=store.path, env=other).ca_file == str(pki.other_ca)
    # The file's CA vouches for its own URL only, like its token.
    elsewhere = resolve(path=store.path, env={"DCTL_URL": "https://other:8700"})
    assert (elsewhere.token, elsewhere.ca_file) == (None, None)


# --- a real control plane over HTTPS -------------------------------------------------------------


def _wait(what: str, probe: Callable[[], T | None], timeout_s: float = 60.0) -> T:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (ClientError, httpx.HTTPError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@dataclass
class TlsServer:
    url: str
    token: str
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    home = tmp_path_factory.mktemp("tls-cp")
    env = {**isolated_env(home), "DCTL_HEARTBEAT_INTERVAL_S": "1", "DCTL_DATA_DIR": str(home)}
    port = free_port()
    argv = [*DCTL, "server", "--migrate", "--port", str(port),
            "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]  # fmt: skip
    with (home / "server.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        with ControlPlaneClient(url, ca_file=pki.ca) as api:
            _wait("the control plane over HTTPS", lambda: proc.poll() is None and api.healthz())
        _, contexts = CredentialsFile(home / "config" / "dctl" / "credentials").load()
        context = contexts["default"]
        assert context.url == url and context.token
        yield TlsServer(url, context.token, home, env, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_the_cli_trusts_the_server_through_its_context_or_ca_file(
    tls_server: TlsServer, pki: Pki
) -> None:
    dctl = Dctl({"XDG_CONFIG_HOME": tls_server.env["XDG_CONFIG_HOME"]})
    # The first start's context trusts the served certificate itself.
    assert dctl("status").code == 0
    assert "server.pem" in dctl("context", "list").stdout

    bare = Dctl({"XDG_CONFIG_HOME": str(tls_server.home / "nobody"), "DCTL_URL": tls_server.url,
                 "DCTL_TOKEN": tls_server.token})  # fmt: skip
    refused = bare("status")
    assert refused.code == 1
    assert "not trusted" in refused.stderr and "--ca-file" in refused.stderr
    assert bare("status", env={"DCTL_CA_FILE": str(pki.ca)}).code == 0
    assert bare("status", env={"DCTL_CA_FILE": str(pki.other_ca)}).code == 1

    added = bare("context", "add", "tls", "--url", tls_server.url, "--ca-file", str(pki.ca),
                 "--token-file", "-", input=tls_server.token + "\n")  # fmt: skip
    assert added.code == 0, added.stderr
    assert bare("status", env={"DCTL_URL": "", "DCTL_TOKEN": "", "DCTL_CONTEXT": "tls"}).code == 0

    plain = bare("status", env={"DCTL_URL": tls_server.url.replace("https", "http")})
    assert plain.code == 1 and "use an https:// URL" in plain.stderr


def test_the_client_without_the_ca_file_sends_nothing(tls_server: TlsServer, pki: Pki) -> None:
    with (
        ControlPlaneClient(tls_server.url, tls_server.token) as untrusting,
        pytest.raises(ClientError, match="--ca-file"),
    ):
        untrusting.status()
    with ControlPlaneClient(tls_server.url, tls_server.token, ca_file=pki.ca) as api:
        assert api.status() is not None


def test_the_agent_link_sends_no_token_to_a_server_it_cannot_verify(
    tls_server: TlsServer, pki: Pki
) -> None:
    request = RegisterRequest(name="never")
    untrusting = ControlPlaneLink(tls_server.url)
    with pytest.raises(ControlPlaneUnavailable, match=r"not trusted.*--ca-file"):
        untrusting.register(request, "dctl_bootstrap_would_leak")
    untrusting.close()
    trusting = ControlPlaneLink(tls_server.url, tls=client_context(pki.ca))
    with pytest.raises(ControlPlaneRejected) as refused:  # verified, then refused: a bad token
        trusting.register(request, "dctl_aaaaaaaaaaaa_" + "b" * 32)
    assert refused.value.status == 401
    trusting.close()


def test_a_world_readable_server_key_is_refused(pki: Pki, tmp_path: Path) -> None:
    key = tmp_path / "open.key"
    key.write_bytes(pki.key.read_bytes())
    key.chmod(0o644)
    result = subprocess.run(
        [*DCTL, "server", "--port", str(free_port()), "--tls-cert", str(pki.cert),
         "--tls-key", str(key)],
        env=isolated_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--tls-key" in result.stderr and "chmod 600" in result.stderr


# --- an agent and its engine over HTTPS ----------------------------------------------------------


def test_an_agent_registers_heartbeats_and_serves_engines_over_https(
    tls_server: TlsServer, pki: Pki
) -> None:
    home, env = tls_server.home, tls_server.env
    cli_env = {**env, "DCTL_URL": tls_server.url, "DCTL_TOKEN": tls_server.token,
               "DCTL_CA_FILE": str(pki.ca)}  # fmt: skip
    checkpoint = home / "ckpt"
    subprocess.run([*DCTL, "model", "create-demo", str(checkpoint), "--random"], env=cli_env,
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    subprocess.run([*DCTL, "model", "register", "demo:v1", str(checkpoint)], env=cli_env,
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    api = ControlPlaneClient(tls_server.url, tls_server.token, ca_file=pki.ca)
    bootstrap = api.create_token(TokenCreate(name="tls-boot", role="bootstrap", uses=1)).secret
    first = free_port()
    data = home / "agent-data"
    argv = [*DCTL, "agent", "--control-plane", tls_server.url, "--ca-file", str(pki.ca),
            "--data-dir", str(data), "--name", "tls-host", "--ports", f"{first}-{first}",
            "--advertise-address", "127.0.0.1", "--gpu-backend", "fake", "--metrics-port", "0",
            "--metrics-tls-cert", str(pki.cert), "--metrics-tls-key", str(pki.key),
            "--engine-tls-cert", str(pki.cert), "--engine-tls-key", str(pki.key),
            "--startup-grace-s", "120", "--allow-root"]  # fmt: skip
    agent_env = {**env, "DCTL_BOOTSTRAP_TOKEN": bootstrap}
    with (home / "agent.log").open("wb") as log:
        agent = subprocess.Popen(argv, env=agent_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        host = _wait("registration over HTTPS", lambda: api.get_host("tls-host"))
        assert host.facts is not None and host.facts.engine_tls
        seen = host.last_seen_at
        _wait("a later heartbeat", lambda: api.get_host("tls-host").last_seen_at != seen)

        # The agent's own /metrics: HTTPS only, verified with the CA.
        metrics_port = _wait("the metrics port", lambda: _read(data / "agent" / "metrics-port"))
        metrics = f"https://127.0.0.1:{metrics_port.strip()}/metrics"
        assert "dctl_agent_heartbeats" in httpx.get(metrics, verify=client_context(pki.ca)).text
        with pytest.raises(httpx.HTTPError):
            httpx.get(metrics.replace("https", "http"), timeout=2)

        api.create_deployment(
            DeploymentCreate(
                name="demo", model="demo", version="v1", placement=Placement(hosts=["tls-host"])
            )
        )

        def ready() -> bool:
            [inst] = api.get_deployment("demo").instances
            return inst.observed_state == "ready"

        try:
            _wait("the engine ready (probed over HTTPS)", ready, 120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_tails(home, data)}") from None
        [inst] = api.get_deployment("demo").instances
        engine = f"https://127.0.0.1:{inst.port}/health/ready"
        assert httpx.get(engine, verify=client_context(pki.cert)).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(engine.replace("https", "http"), timeout=2)
        config = (data / "agent" / "run" / f"instance-{inst.id}.yaml").read_text()
        assert f"tls_cert: {pki.cert}" in config
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        api.close()
        for pid_file in (data / "agent" / "run").glob("instance-*.json"):
            # Agents leave engines running on exit, for the next one to adopt.
            with contextlib.suppress(ProcessLookupError):
                os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGKILL)


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _tails(*directories: Path) -> str:
    logs = [p for d in directories for p in sorted(d.rglob("*.log"))]
    return "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
        for p in logs
    )


@pytest.mark.parametrize(
    ("host", "warned"),
    [("0.0.0.0", True), ("::", True), ("10.1.2.3", True), ("127.0.0.1", False)],
)
def test_plain_http_on_every_interface_is_warned_about(
    host: str, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.main import tls_files
    from controlplane.settings import ControlPlaneSettings

    assert tls_files(ControlPlaneSettings(host=host)) is None
    err = capsys.readouterr().err
    assert ("tokens travel in clear" in err) is warned
