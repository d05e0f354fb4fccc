"""The Kubernetes manifests: valid objects, consistent ports and names, and pods that really start.

deploy/secret.yaml and deploy/k8s/*.yaml are validated against the Kubernetes 1.37 schemas
(kubernetes-validate, strict: an unknown field is an error); the TFJob of deploy/tfjob.yaml has
no schema there, so each of its replica templates is validated as a Pod. Then each kind of pod is
started as the asyncps role it names, on localhost, with exactly its args and environment
(TF_CONFIG as the training operator writes it for the TFJob; the downward-API fields resolved as
the kubelet would), only its ports rewritten to free ones and its mount paths to local
directories (the Secret's keys: a development CA, certificate and token). A shard and the chief
must answer SERVING on the plaintext health port their grpc probes name, and the shard (with
TLS and the token) also on its serving port; a worker must register with the chief.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from asyncps.net.security import SecurityConfig, check_health
from asyncps.tools.devcerts import generate_dev_certs
from tests.conftest import REPO_ROOT, child_env

DEPLOY = REPO_ROOT / "deploy"
K8S_VERSION = "1.37"
SECRETS_MOUNT = "/etc/asyncps/secrets"
START_TIMEOUT_S = 90.0


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def plain_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """The plain variant's objects (and the shared Secret) by (kind, name)."""
    docs = load(DEPLOY / "secret.yaml")
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += load(path)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def tfjob() -> dict[str, Any]:
    (job,) = load(DEPLOY / "tfjob.yaml")
    return job


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec["containers"]
    return only  # type: ignore[no-any-return]


def env_value(ctr: dict[str, Any], name: str) -> str:
    (value,) = [e["value"] for e in ctr.get("env", []) if e["name"] == name]
    return str(value)


# -- the objects ---------------------------------------------------------------------------------
def test_plain_objects_validate_against_the_kubernetes_schemas() -> None:
    objects = plain_objects()
    assert set(objects) == {("Secret", "asyncps-secrets"), ("Service", "asyncps-ps"),
                            ("StatefulSet", "asyncps-ps"), ("PersistentVolumeClaim", "asyncps-runs"),
                            ("Service", "asyncps-chief"), ("Job", "asyncps-chief"), ("Job", "asyncps-worker")}
    for doc in objects.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_tfjob_pod_templates_validate_as_pods() -> None:
    job = tfjob()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "PS", "Worker"}
    for kind, spec in specs.items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"asyncps-digits-{kind.lower()}-0"},
               "spec": spec["template"]["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        ctr = container(spec["template"]["spec"])
        assert ctr["name"] == "tensorflow", kind  # the operator finds its container by this name
        assert [p["containerPort"] for p in ctr["ports"] if p["name"] == "tfjob-port"] == [8470], kind
    # a shard's TCP data port: fixed, declared, apart from its gRPC and health ports
    shard = container(specs["PS"]["template"]["spec"])
    data_port = int(env_value(shard, "ASYNCPS_DATA_PORT"))
    assert [p["containerPort"] for p in shard["ports"] if p["name"] == "data"] == [data_port]
    assert data_port not in (8470, int(env_value(shard, "ASYNCPS_HEALTH_PORT")))


def test_a_schema_violation_is_caught() -> None:
    """The validation above can fail: a misspelt probe field and a string port are errors."""
    job = plain_objects()[("Job", "asyncps-chief")]
    ctr = container(job["spec"]["template"]["spec"])
    bad = json.loads(json.dumps(job))
    container(bad["spec"]["template"]["spec"])["readinessProbe"] = {"grpcc": {"port": 8471}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = json.loads(json.dumps(job))
    container(bad["spec"]["template"]["spec"])["livenessProbe"] = {"grpc": {"port": "health"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    assert ctr["livenessProbe"]["grpc"]["port"] == 8471


def server_pod_specs() -> list[tuple[str, dict[str, Any]]]:
    objects = plain_objects()
    found = [(f"k8s {kind} {name}", doc["spec"]["template"]["spec"]) for (kind, name), doc in objects.items()
             if kind in ("StatefulSet", "Job") and name != "asyncps-worker"]
    found += [(f"tfjob {kind}", spec["template"]["spec"]) for kind, spec in tfjob()["spec"]["tfReplicaSpecs"].items()
              if kind != "Worker"]
    return found


@pytest.mark.parametrize("where, spec", server_pod_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_probes_ask_the_health_port_the_role_serves(where: str, spec: dict[str, Any]) -> None:
    ctr = container(spec)
    health = int(env_value(ctr, "ASYNCPS_HEALTH_PORT"))
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports["health"] == health, where
    assert any(port != health for port in ports.values()), f"{where}: serving and health port are one"
    for probe in ("readinessProbe", "livenessProbe"):
        assert ctr[probe]["grpc"]["port"] == health, f"{where}: {probe}"
    assert "resources" in ctr and ctr["resources"]["requests"], where
    assert "command" not in ctr, f"{where}: the image's entrypoint (asyncps) runs unchanged"


def test_plain_names_and_ports_agree() -> None:
    """The chief's shard list, the headless Service, the StatefulSet and the workers' chief address."""
    objects = plain_objects()
    sts = objects[("StatefulSet", "asyncps-ps")]
    headless = objects[("Service", "asyncps-ps")]
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "asyncps-ps"
    shard = container(sts["spec"]["template"]["spec"])
    ps_port = int(env_value(shard, "ASYNCPS_PORT"))
    # the TCP data port: fixed per shard, named by the Service and the container (a worker dials the
    # shard's name at the port its DataPort call announces), apart from the gRPC and health ports
    data_port = int(env_value(shard, "ASYNCPS_DATA_PORT"))
    assert data_port > 0 and data_port not in (ps_port, int(env_value(shard, "ASYNCPS_HEALTH_PORT")))
    assert {p["name"]: (p["port"], p["targetPort"]) for p in headless["spec"]["ports"]} == {
        "grpc": (ps_port, ps_port), "data": (data_port, data_port)}
    assert {p["name"]: p["containerPort"] for p in shard["ports"]}.items() >= {"grpc": ps_port,
                                                                               "data": data_port}.items()
    chief = container(objects[("Job", "asyncps-chief")]["spec"]["template"]["spec"])
    expected = [f"asyncps-ps-{i}.asyncps-ps:{ps_port}" for i in range(sts["spec"]["replicas"])]
    assert env_value(chief, "ASYNCPS_PS").split(",") == expected
    chief_service = objects[("Service", "asyncps-chief")]
    (svc_port,) = chief_service["spec"]["ports"]
    assert svc_port["targetPort"] == int(env_value(chief, "ASYNCPS_PORT"))
    worker = container(objects[("Job", "asyncps-worker")]["spec"]["template"]["spec"])
    assert env_value(worker, "ASYNCPS_CHIEF") == f"asyncps-chief:{svc_port['port']}"
    # Each Service selects the pods it names, and the StatefulSet its own template.
    chief_labels = objects[("Job", "asyncps-chief")]["spec"]["template"]["metadata"]["labels"]
    assert chief_service["spec"]["selector"].items() <= chief_labels.items()
    ps_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= ps_labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= ps_labels.items()
    assert not headless["spec"]["selector"].items() <= chief_labels.items()


# -- the pods, started as local processes --------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pod:
    """One pod of a manifest: its spec, what the kubelet (and the operator) would give it."""

    name: str
    spec: dict[str, Any]
    address: str = ""  # host:port that clients dial for it (its Service's, or its TF_CONFIG entry)
    labels: dict[str, str] = field(default_factory=dict)
    tf_config: dict[str, Any] | None = None


class LocalPods:
    """Starts pods as local asyncps processes: the container's args after the image's entrypoint
    (`asyncps`), its env resolved as the kubelet would, ports and mount paths made local."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.secrets = tmp / "secrets"
        generate_dev_certs(self.secrets, ["asyncps-chief"])  # and 127.0.0.1, which every address becomes
        (self.secrets / "token").write_text(secrets.token_urlsafe(24) + "\n")
        (self.secrets / "chief-token").write_text(secrets.token_urlsafe(24) + "\n")
        self.security = SecurityConfig.from_flags(str(self.secrets / "token"), str(self.secrets / "server.pem"),
                                                  str(self.secrets / "server.key"), str(self.secrets / "ca.pem"))
        self.addresses: dict[str, str] = {}  # cluster address -> 127.0.0.1:free port
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def local(self, address: str) -> str:
        """The local stand-in of a cluster address (one free port per address)."""
        if address not in self.addresses:
            self.addresses[address] = f"127.0.0.1:{free_port()}"
        return self.addresses[address]

    def _mounts(self, pod: Pod) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        mounts = {}
        for mount in container(pod.spec).get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "secret" in volume:
                assert volume["secret"]["secretName"] == "asyncps-secrets"
                mounts[mount["mountPath"]] = self.secrets
                if "items" in volume["secret"]:  # only these keys, as the kubelet mounts them
                    local = self.tmp / pod.name / mount["name"]
                    local.mkdir(parents=True, exist_ok=True)
                    for item in volume["secret"]["items"]:
                        (local / item["path"]).write_bytes((self.secrets / item["key"]).read_bytes())
                    mounts[mount["mountPath"]] = local
            else:
                local = self.tmp / pod.name / mount["name"]
                local.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"]] = local
        return mounts

    def env(self, pod: Pod) -> dict[str, str]:
        """The container's environment, localized: ports, cluster addresses, mount paths."""
        mounts = self._mounts(pod)
        env: dict[str, str] = {}
        for item in container(pod.spec).get("env", []):
            if "value" in item:
                value = str(item["value"])
            else:
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
                assert label is not None, f"{pod.name}: no local stand-in for {path}"
                value = pod.labels[label.group(1)]
            if item["name"] == "ASYNCPS_PORT":  # what its Service routes to: the port clients dial
                assert value == pod.address.rsplit(":", 1)[1], (pod.name, value, pod.address)
                value = self.local(pod.address).rsplit(":", 1)[1]
            elif item["name"] in ("ASYNCPS_HEALTH_PORT", "ASYNCPS_DATA_PORT"):
                value = str(free_port())
            for address in re.findall(r"[A-Za-z0-9.-]+:\d+", value):
                value = value.replace(address, self.local(address))
            for mount, local in mounts.items():
                if value == mount or value.startswith(mount + "/"):
                    value = str(local) + value[len(mount):]
            env[item["name"]] = value
        if pod.tf_config is not None:
            cluster = {role: [self.local(a) for a in addresses] for role, addresses in pod.tf_config["cluster"].items()}
            env["TF_CONFIG"] = json.dumps({**pod.tf_config, "cluster": cluster})
        return env

    def start(self, pod: Pod) -> dict[str, str]:
        """Start the pod's role; return its localized environment."""
        ctr = container(pod.spec)
        assert "command" not in ctr and ctr["args"][0] in ("ps", "chief", "worker"), ctr
        env = self.env(pod)
        log = self.tmp / f"{pod.name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "asyncps.tools.cli", *ctr["args"]],
                                    env={**child_env(), **env}, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append((pod.name, proc, log))
        return env

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{log.read_text(errors='replace')[-2500:]}" for name, _, log in self.procs)

    def wait_healthy(self, address: str, security: SecurityConfig, what: str) -> float:
        start = time.monotonic()
        while not check_health(address, security, 2.0):
            dead = [name for name, p, _ in self.procs if p.poll() is not None]
            assert not dead, f"{dead} exited before {what} was healthy\n{self.logs()}"
            assert time.monotonic() - start < START_TIMEOUT_S, f"{what} not healthy\n{self.logs()}"
            time.sleep(0.3)
        return time.monotonic() - start

    def wait_for_log(self, name: str, pattern: str) -> re.Match[str]:
        (log,) = [log for n, _, log in self.procs if n == name]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            found = re.search(pattern, log.read_text(errors="replace"))
            if found:
                return found
            assert time.monotonic() < deadline, f"no {pattern!r} from {name}\n{self.logs()}"
            time.sleep(0.3)

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
        for _, proc, _ in self.procs:
            proc.wait(timeout=30)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[LocalPods]:
    launcher = LocalPods(tmp_path)
    try:
        yield launcher
    finally:
        launcher.stop()


def start_shards(pods: LocalPods, shards: list[Pod]) -> None:
    """Start the shard pods; each must answer SERVING on its probe port and, over mTLS with the
    token (and only so), on its serving port, with the index of its pod."""
    plain = SecurityConfig()  # what the kubelet's grpc probe speaks
    for index, shard in enumerate(shards):
        env = pods.start(shard)
        pods.wait_healthy(f"127.0.0.1:{env['ASYNCPS_HEALTH_PORT']}", plain, f"{shard.name}'s health port")
        serving = pods.local(shard.address)
        pods.wait_healthy(serving, pods.security, f"{shard.name} over mTLS with the token")
        assert not check_health(serving, plain, 1.0), f"{shard.name} answers in plaintext: TLS is off"
        pods.wait_for_log(shard.name, rf"shard {index} serving on port {serving.rsplit(':', 1)[1]} ")
        if "ASYNCPS_DATA_PORT" in env:  # the TCP data path listens where the manifest says, over TLS
            pods.wait_for_log(shard.name, rf"data port {env['ASYNCPS_DATA_PORT']} \(TLS")


def start_chief_and_worker(pods: LocalPods, chief: Pod, worker: Pod) -> int:
    """Start the chief and a worker pod (the shards run); the chief must answer SERVING on its probe
    port and over mTLS, the worker register. Returns the index the worker registered as."""
    env = pods.start(chief)
    pods.start(worker)  # it retries the chief until it serves, as in the cluster
    took = pods.wait_healthy(f"127.0.0.1:{env['ASYNCPS_HEALTH_PORT']}", SecurityConfig(), "the chief's health port")
    pods.wait_healthy(pods.local(chief.address), pods.security, "the chief over mTLS with the token")
    print(f"{chief.name}: healthy {took:.1f}s after its start")
    return int(pods.wait_for_log(worker.name, r"registered as worker (\d+) of 2 ").group(1))


def plain_pods() -> tuple[list[Pod], Pod, Pod]:
    """The plain variant's shard pods, chief pod and a worker pod, as the kubelet would run them."""
    objects = plain_objects()
    sts = objects[("StatefulSet", "asyncps-ps")]
    template = sts["spec"]["template"]
    shards = [Pod(f"asyncps-ps-{i}", template["spec"], f"asyncps-ps-{i}.asyncps-ps:8470",
                  {**template["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(i)})
              for i in range(sts["spec"]["replicas"])]
    chief = Pod("asyncps-chief", objects[("Job", "asyncps-chief")]["spec"]["template"]["spec"], "asyncps-chief:8470")
    worker = Pod("asyncps-worker", objects[("Job", "asyncps-worker")]["spec"]["template"]["spec"])
    return shards, chief, worker


def tfjob_pods() -> tuple[list[Pod], Pod, Pod]:
    """The TFJob's shard pods, chief pod and second worker pod, with the TF_CONFIG the operator writes."""
    job = tfjob()
    name, namespace = job["metadata"]["name"], "default"
    replicas = job["spec"]["tfReplicaSpecs"]

    def address(kind: str, index: int) -> str:  # the operator's Service per replica, at its tfjob-port
        (port,) = [p["containerPort"] for p in container(replicas[kind]["template"]["spec"])["ports"]
                   if p["name"] == "tfjob-port"]
        return f"{name}-{kind.lower()}-{index}.{namespace}.svc:{port}"

    cluster = {kind.lower(): [address(kind, i) for i in range(spec["replicas"])] for kind, spec in replicas.items()}

    def pod(kind: str, index: int) -> Pod:
        return Pod(f"{name}-{kind.lower()}-{index}", replicas[kind]["template"]["spec"], address(kind, index),
                   tf_config={"cluster": cluster, "task": {"type": kind.lower(), "index": index},
                              "environment": "cloud"})

    return [pod("PS", i) for i in range(replicas["PS"]["replicas"])], pod("Chief", 0), pod("Worker", 1)


def test_plain_shard_pods_start_with_their_environment(pods: LocalPods) -> None:
    start_shards(pods, plain_pods()[0])


def test_tfjob_shard_pods_start_with_their_environment_and_tf_config(pods: LocalPods) -> None:
    start_shards(pods, tfjob_pods()[0])


# The chief loads TensorFlow and the dataset before it serves (~15-30 s here): the long suite.
@pytest.mark.slow
def test_plain_chief_and_worker_pods_start_with_their_environment(pods: LocalPods) -> None:
    shards, chief, worker = plain_pods()
    start_shards(pods, shards)
    assert start_chief_and_worker(pods, chief, worker) == 0  # its index comes from the chief


@pytest.mark.slow
def test_tfjob_chief_and_worker_pods_start_with_their_environment_and_tf_config(pods: LocalPods) -> None:
    shards, chief, worker = tfjob_pods()
    start_shards(pods, shards)
    assert start_chief_and_worker(pods, chief, worker) == 1  # TF_CONFIG's task.index
