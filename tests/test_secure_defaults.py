"""Secure defaults: the roles bind loopback unless told otherwise, a server open to the network
without a token says so at start, a shard imports only the plugin modules its own command line (or
an installed entry point) allows, and the chief's metrics endpoint takes the cluster's token and TLS.

Each test here fails on a tree without these defaults (0.0.0.0, silence, any module a request
names, an open plaintext /metrics)."""

from __future__ import annotations

import math
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.metrics import MetricsServer, RunMetrics
from asyncps.ps.main import PsConfig
from asyncps.ps.service import ShardService
from asyncps.ps.store import ShardStore
from asyncps.ps.tcp import TcpShardServer

from asyncps.errors import PermissionDeniedError
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig, exposure_warning, is_loopback
from asyncps.rules import POLICIES, OptimizerConfig, UpdateRuleConfig
from asyncps.rules.registry import PluginNotAllowed, import_plugin_modules, plugin_modules_only
from asyncps.rundir import wait_port_file
from asyncps.tools.cli import build_parser
from asyncps.tools.devcerts import DevCerts, generate_dev_certs
from asyncps.transport import connect_shard
from asyncps.wire.proto import rule_from_proto, rule_to_proto
from tests.conftest import REPO_ROOT, START_TIMEOUT_S, STOP_TIMEOUT_S, ShardLauncher, child_env

TOKEN, CHIEF_TOKEN = "workers-token-0123456789", "chief-token-0123456789"
VALUES = {"w": np.zeros(2, np.float32)}


# -- loopback unless told otherwise ------------------------------------------------------------------
def listening_hosts(pid: int) -> dict[int, set[str]]:
    """Every port process pid listens on, with its local addresses ('127.0.0.1', '0.0.0.0', '::'), from
    /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports: dict[int, set[str]] = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, state, inode = fields[1], fields[3], fields[9]
            host_hex, port_hex = address.split(":")
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(host_hex)
                # /proc writes each 32-bit word in host order (little-endian here)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                host = socket.inet_ntop(family, words)
                # a dual-stack socket bound to an IPv4 address shows it IPv4-mapped
                ports.setdefault(int(port_hex, 16), set()).add(host.removeprefix("::ffff:"))
    return ports


def test_the_role_flags_and_configs_default_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCPS_HOST", raising=False)
    parser = build_parser()
    assert parser.parse_args(["ps"]).host == parser.parse_args(["chief"]).host == LOOPBACK_HOST == "127.0.0.1"
    assert PsConfig().host == LOOPBACK_HOST
    with pytest.raises(ValueError, match="--host is empty"):  # never every interface by accident
        PsConfig(host=" ")
    monkeypatch.setenv("ASYNCPS_HOST", "0.0.0.0")  # what the images and manifests set
    assert build_parser().parse_args(["ps"]).host == "0.0.0.0"
    # a shard's own listener (the TCP data port) too
    server = TcpShardServer(ShardService(ShardStore())).start()
    try:
        assert server._listener.getsockname()[0] == "127.0.0.1"
    finally:
        server.stop()


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads /proc/PID/net (Linux)")
def test_a_shard_started_without_host_listens_on_loopback_only(tmp_path: Path) -> None:
    port_file, log_path = tmp_path / "ps.port", tmp_path / "ps.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "asyncps.tools.cli", "ps", "--port", "0", "--port-file",
                                 str(port_file), "--chief-timeout-s", "0", "--data-port", "0"],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO_ROOT)
    try:
        port = wait_port_file(port_file, START_TIMEOUT_S, alive=lambda: proc.poll() is None)
        listening = listening_hosts(proc.pid)
        # the gRPC port and the TCP data port, both on loopback only
        assert port in listening and len(listening) == 2 and all(h == {"127.0.0.1"} for h in listening.values()), \
            listening
    finally:
        proc.terminate()
        proc.wait(timeout=STOP_TIMEOUT_S)
    text = log_path.read_text()
    assert f"serving on port {port} of 127.0.0.1 " in text and "WARNING" not in text, text


def test_loopback_is_told_from_addresses_others_reach() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "[::]", "10.0.0.5", "ps-0", ""))


# -- a server open to the network says so ------------------------------------------------------------
def test_the_exposure_warning_names_the_address_and_the_flags() -> None:
    warning = exposure_warning("shard 0", "0.0.0.0:8470", SecurityConfig())
    assert warning is not None and "0.0.0.0:8470" in warning
    assert "--token-file" in warning and "--chief-token-file" in warning and "--host 127.0.0.1" in warning
    assert exposure_warning("shard 0", "[::]:8470", SecurityConfig()) is not None
    assert exposure_warning("shard 0", "127.0.0.1:8470", SecurityConfig()) is None
    assert exposure_warning("shard 0", "0.0.0.0:8470", SecurityConfig(token=TOKEN, chief_token=CHIEF_TOKEN)) is None


def test_a_shard_on_every_interface_without_a_token_warns_once(shard_factory: ShardLauncher, tmp_path: Path) -> None:
    token_file, chief_token_file = tmp_path / "token", tmp_path / "chief-token"
    token_file.write_text(TOKEN)
    chief_token_file.write_text(CHIEF_TOKEN)
    [open_shard] = shard_factory(1, args=("--host", "0.0.0.0"))
    [guarded] = shard_factory(1, args=("--host", "0.0.0.0", "--token-file", str(token_file),
                                       "--chief-token-file", str(chief_token_file)))
    warnings = [line for line in open_shard.log_tail(20_000).splitlines() if " WARNING " in line]
    assert len(warnings) == 1, open_shard.log_tail()
    port = open_shard.address.rsplit(":", 1)[1]
    assert f"0.0.0.0:{port}" in warnings[0] and "--token-file" in warnings[0], warnings[0]
    assert " WARNING " not in guarded.log_tail(20_000), guarded.log_tail()


# -- plugins: only what the shard's command line allows ----------------------------------------------
PLUGIN = '''
    """A staleness policy whose import leaves a mark: which processes imported it."""
    import os
    from dataclasses import dataclass
    from pathlib import Path

    from asyncps.rules.policies import Decision, StalenessPolicy

    Path(__file__).with_name(f"imported-by-{os.getpid()}").touch()


    @dataclass(frozen=True)
    class Keep(StalenessPolicy):
        """Applies every push."""

        def decide(self, staleness: int) -> Decision:
            return Decision(True)
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory holding the module `marked_plugin_<n>` (fresh per test, so no process has it loaded)
    and an installed distribution whose entry point `marked-<n>` names it."""
    directory = tmp_path / "plugins"
    directory.mkdir()
    name = f"marked_plugin_{os.getpid()}_{len(list(tmp_path.parent.iterdir()))}"
    (directory / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    dist = directory / f"{name}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[asyncps.policies]\n{name.replace('_', '-')} = {name}:Keep\n")
    monkeypatch.syspath_prepend(str(directory))  # the test builds the rules too
    yield directory
    sys.modules.pop(name, None)


def module_of(plugin_dir: Path) -> str:
    return next(plugin_dir.glob("marked_plugin_*.py")).stem


def imported_by(plugin_dir: Path, pid: int) -> bool:
    return (plugin_dir / f"imported-by-{pid}").exists()


def test_a_shard_refuses_a_plugin_module_its_command_line_does_not_name(
        shard_factory: ShardLauncher, plugin_dir: Path) -> None:
    module = module_of(plugin_dir)
    [shard] = shard_factory(1, args=("--user-path", str(plugin_dir)))
    frames = connect_shard(shard.address)
    try:
        rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.5), staleness_policy=f"{module}:Keep")
        with pytest.raises(PermissionDeniedError) as refused:
            frames.initialize("chief", 0, 1, rule, VALUES)
        assert refused.value.code == "PERMISSION_DENIED"
        details = refused.value.detail
        assert f"--plugins {module}" in details and "asyncps.policies" in details, details
        assert not imported_by(plugin_dir, shard.process.pid), "the shard imported the module a request named"
        assert not frames.stats().initialized  # nothing changed
        assert frames.initialize("chief", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 0.5)), VALUES).created
    finally:
        frames.close()


def test_a_shard_loads_the_plugins_its_command_line_or_an_entry_point_allows(
        shard_factory: ShardLauncher, plugin_dir: Path) -> None:
    module = module_of(plugin_dir)
    [listed] = shard_factory(1, args=("--user-path", str(plugin_dir), "--plugins", module))
    [installed] = shard_factory(1, args=("--user-path", str(plugin_dir)))
    # imported at start, so that a typo in --plugins fails there and then
    assert imported_by(plugin_dir, listed.process.pid)
    frames = connect_shard(listed.address)
    try:
        assert frames.initialize("chief", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 0.5),
                                                                 staleness_policy=f"{module}:Keep"), VALUES).created
        assert frames.stats().rule.staleness_policy == f"{module}:Keep"
    finally:
        frames.close()
    # the installed entry point, by its name: allowed without --plugins
    frames = connect_shard(installed.address)
    entry_point = module.replace("_", "-")
    try:
        assert frames.initialize("chief", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 0.5),
                                                                 staleness_policy=entry_point), VALUES).created
    finally:
        frames.close()


def test_a_plugin_that_cannot_be_imported_fails_the_shard_at_start(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "ps", "--port", "0", "--chief-timeout-s", "0",
                             "--plugins", "no_such_module_here"], capture_output=True, text=True,
                            env=child_env(), cwd=REPO_ROOT, timeout=START_TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    assert "--plugins: cannot import no_such_module_here" in result.stderr


def test_a_request_spec_imports_only_allowed_modules(plugin_dir: Path) -> None:
    module = module_of(plugin_dir)
    spec = rule_to_proto(UpdateRuleConfig(OptimizerConfig("sgd", 0.5)))
    spec.staleness_policy = f"{module}:Keep"  # as a request sends it, unparsed here
    with plugin_modules_only(frozenset()), pytest.raises(PermissionDeniedError, match=f"--plugins {module}"):
        rule_from_proto(spec)
    assert module not in sys.modules
    with plugin_modules_only(frozenset({"json"})), pytest.raises(PluginNotAllowed):
        POLICIES.parse(f"{module}:Keep")
    with plugin_modules_only(frozenset({module})):
        assert rule_from_proto(spec).staleness_policy == f"{module}:Keep"
    assert module in sys.modules
    assert UpdateRuleConfig(OptimizerConfig("sgd", 0.5), staleness_policy=f"{module}:Keep").plugin_modules() == \
        (module,)
    assert UpdateRuleConfig(OptimizerConfig("sgd", 0.5), staleness_policy="drop:bound=2").plugin_modules() == ()
    assert import_plugin_modules([" json ", "", "email.mime"]) == {"json", "email.mime"}
    with pytest.raises(ValueError, match="not a module name"):
        import_plugin_modules(["json:loads"])


def test_a_package_on_the_list_allows_its_modules() -> None:
    with plugin_modules_only(frozenset({"email"})):
        from asyncps.rules.registry import plugin_module_allowed

        assert plugin_module_allowed("email.mime") and plugin_module_allowed("email")
        assert not plugin_module_allowed("emailx") and not plugin_module_allowed("json")
    assert plugin_module_allowed("json")  # outside: the process's own command line, anything


# -- the metrics endpoint takes the cluster's token and TLS ------------------------------------------
def metrics() -> RunMetrics:
    return RunMetrics(updates=7, updates_per_s=1.5, dropped_by_reason={}, staleness={0: 3, 2: 4}, live_workers=2,
                      planned_workers=2, eval_loss=math.nan, eval_accuracy=0.0, epochs=0.1, fraction_done=-1.0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return generate_dev_certs(tmp_path_factory.mktemp("certs"))


def scrape(url: str, token: str = "", context: ssl.SSLContext | None = None) -> tuple[int, str]:
    """(status, body) of a GET, by the standard library's HTTP client."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_need_the_cluster_token_when_it_has_one() -> None:
    server = MetricsServer("127.0.0.1", 0, metrics, SecurityConfig(token=TOKEN, chief_token=CHIEF_TOKEN))
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        status, body = scrape(url)
        assert status == 401 and "missing token" in body and "Authorization: Bearer" in body
        assert scrape(url, "not-the-token")[0] == 401
        for token in (TOKEN, CHIEF_TOKEN):  # either role's token may read
            status, body = scrape(url, token)
            assert status == 200 and "asyncps_updates_total 7.0" in body
    finally:
        server.close()
    open_server = MetricsServer("127.0.0.1", 0, metrics)  # no token in the cluster: open, as before
    try:
        assert scrape(f"http://127.0.0.1:{open_server.port}/metrics")[0] == 200
    finally:
        open_server.close()


def test_metrics_are_served_over_the_clusters_tls_and_mtls(certs: DevCerts) -> None:
    trust = ssl.create_default_context(cafile=str(certs.ca_cert))
    tls = SecurityConfig(tls_cert=str(certs.chief_cert), tls_key=str(certs.chief_key), tls_ca=str(certs.ca_cert),
                         require_client_cert=False)
    server = MetricsServer("127.0.0.1", 0, metrics, tls)
    try:
        # a client that never finishes its handshake holds no other scrape up
        with socket.create_connection(("127.0.0.1", server.port)):
            assert scrape(f"https://localhost:{server.port}/metrics", context=trust)[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to a TLS port
            scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
    mtls = SecurityConfig(token=TOKEN, shared_token=True, tls_cert=str(certs.chief_cert), tls_key=str(certs.chief_key),
                          tls_ca=str(certs.ca_cert))
    server = MetricsServer("127.0.0.1", 0, metrics, mtls)
    url = f"https://localhost:{server.port}/metrics"
    try:
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            scrape(url, TOKEN, context=trust)  # no client certificate
        trust.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        assert scrape(url, context=trust)[0] == 401  # a certificate, but no token
        assert scrape(url, TOKEN, context=trust)[0] == 200
    finally:
        server.close()


@pytest.mark.slow
def test_a_secure_local_clusters_chief_serves_metrics_over_mtls_with_its_token(tmp_path: Path) -> None:
    from asyncps.config import RunConfig
    from asyncps.tools.devcerts import cert_paths
    from asyncps.tools.local import LocalCluster

    run = RunConfig(num_ps=1, num_workers=1, epochs=0, max_training_s=120, compute_delay="const:0.01")
    cluster = LocalCluster(run, tmp_path / "run", secure=True, prometheus_port=0)
    cluster.run_dir.mkdir(parents=True)
    try:
        cluster.start()
        port = wait_port_file(cluster.files.port_file("chief.metrics"), 120, alive=cluster.chief.alive)
        secrets = cluster.files.secrets
        certs = cert_paths(secrets)
        client = ssl.create_default_context(cafile=str(certs.ca_cert))
        client.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        url = f"https://localhost:{port}/metrics"
        assert scrape(url, context=client)[0] == 401
        status, body = scrape(url, (secrets / "token").read_text().strip(), context=client)
        assert status == 200 and "asyncps_updates_total" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            scrape(f"http://127.0.0.1:{port}/metrics")
        assert " WARNING " not in cluster.files.log("chief").read_text()  # loopback, tokens: nothing to say
    finally:
        cluster.interrupt()
        cluster.stop(grace_s=5)
