"""deploy/k8s: every rendered manifest is valid Kubernetes, and everything it names is real.

No cluster runs on these machines, so, as tests/test_compose.py does for compose, the
manifests are checked against the Kubernetes schemas (``kubernetes-validate``) and against
the code: each container's command imports and runs, each probe path is a route of that
service's app, each port is the service's default port, each ``TANDEM_`` variable is a
setting and its value parses.

The overlays are rendered by the small kustomize subset below (what deploy/k8s uses, and
nothing more: anything else is refused). Where ``kubectl`` is installed, its own kustomize
renders them too and the two renderings must agree, which keeps the subset honest.
"""

from __future__ import annotations

import base64
import copy
import importlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic_settings import BaseSettings

from services.cli.envdoc import all_env_vars, settings_classes
from services.common.config import DEFAULT_PORTS, SettingsError, check_unknown_env, load_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# Oldest Kubernetes release the manifests promise to work on, and the newest schema known.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
KNOWN_KUSTOMIZATION_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "labels",
    "secretGenerator",
    "generatorOptions",
}
WORKLOADS = ("Deployment", "StatefulSet")

Doc = dict[str, Any]


# --- a kustomize subset ---------------------------------------------------------------


def _merge_key(field: str) -> str:
    # Kubernetes' strategic-merge keys for the lists deploy/k8s patches.
    return {"volumeMounts": "mountPath", "ports": "containerPort"}.get(field, "name")


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes' strategic merge for maps and for lists of named maps; other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    key = _merge_key(field)
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and key in x for x in [*base, *patch])
    ):
        out_list = [copy.deepcopy(x) for x in base]
        for item in patch:
            match = [i for i, x in enumerate(out_list) if x[key] == item[key]]
            if match:
                out_list[match[0]] = strategic_merge(out_list[match[0]], item, field)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _ident(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def render(folder: Path) -> list[Doc]:
    """Render a kustomization folder the way ``kustomize build`` does, for the features used."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_KUSTOMIZATION_KEYS
    assert not unknown, f"{folder}: the test's kustomize subset does not handle {unknown}"
    docs: list[Doc] = []
    for res in spec.get("resources", []):
        path = (folder / res).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    options = spec.get("generatorOptions", {})
    for gen in spec.get("secretGenerator", []):
        # Name hashes would need reference rewriting, which this subset does not do.
        assert options.get("disableNameSuffixHash") is True
        assert set(gen) <= {"name", "envs"}, gen
        data: dict[str, str] = {}
        for env_file in gen["envs"]:
            for line in (folder / env_file).read_text().splitlines():  # a missing file stops the build
                if line.strip() and not line.lstrip().startswith("#"):
                    key, _, value = line.partition("=")
                    data[key.strip()] = base64.b64encode(value.encode()).decode()
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": gen["name"]},
                "type": "Opaque",
                "data": data,
            }
        )
    for label in spec.get("labels", []):
        assert set(label) == {"pairs"}, "only plain metadata labels are handled"
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
    for patch in spec.get("patches", []):
        assert set(patch) == {"path"}, patch
        body = yaml.safe_load((folder / patch["path"]).read_text())
        targets = [i for i, d in enumerate(docs) if _ident(d) == _ident(body)]
        assert len(targets) == 1, f"patch {patch['path']} matches {len(targets)} resources"
        docs[targets[0]] = strategic_merge(docs[targets[0]], body)
    return docs


def _canonical(value: Any, field: str = "") -> Any:
    """Order-free form for comparing renderings: maps by key, named lists by their key,
    Secret data decoded (kubectl wraps long base64 lines)."""
    if isinstance(value, dict) and value.get("kind") == "Secret":
        value = {**value, "data": {k: base64.b64decode(v).decode() for k, v in value["data"].items()}}
    if isinstance(value, dict):
        return {k: _canonical(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items = [_canonical(x, field) for x in value]
        key = _merge_key(field)
        if all(isinstance(x, dict) and key in x for x in items):
            return sorted(items, key=lambda x: str(x[key]))
        return items
    return value


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s_copy() -> Iterator[Path]:
    """deploy/k8s in a temp folder, with secrets made by the documented script."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "k8s"
        shutil.copytree(K8S, dest, ignore=shutil.ignore_patterns("secrets.env"))
        run = subprocess.run(["sh", str(dest / "make-secrets.sh")], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        yield dest


@pytest.fixture(scope="module")
def rendered(k8s_copy: Path) -> dict[str, list[Doc]]:
    out = {name: render(k8s_copy / "overlays" / name) for name in OVERLAYS}
    out["base"] = render(k8s_copy / "base")
    return out


@pytest.fixture(scope="module")
def secret_env(k8s_copy: Path) -> dict[str, str]:
    lines = (k8s_copy / "base" / "secrets.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line)


@pytest.fixture(scope="module")
def app_routes() -> Iterator[dict[str, Any]]:
    """Each service's app, built as uvicorn's factory call builds it (no lifespan run)."""
    from fastapi.testclient import TestClient

    with tempfile.TemporaryDirectory() as home:
        old = os.environ.get("TANDEM_HOME")
        os.environ["TANDEM_HOME"] = home
        try:
            clients = {
                svc: TestClient(importlib.import_module(f"services.{svc}.app").create_app())
                for svc in DEFAULT_PORTS
            }
            yield clients
        finally:
            if old is None:
                os.environ.pop("TANDEM_HOME", None)
            else:
                os.environ["TANDEM_HOME"] = old


def _of(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, c


def _tandem_containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for doc, c in _containers(docs):
        if c["image"].split(":")[0] in ("tandem", "tandem-gpu"):
            yield doc, c


# --- rendering and schemas --------------------------------------------------------------


def test_kustomize_subset_agrees_with_kubectl(k8s_copy: Path, rendered: dict[str, list[Doc]]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the overlays are rendered by the test's kustomize subset only")
    for name in OVERLAYS:
        run = subprocess.run(
            [kubectl, "kustomize", str(k8s_copy / "overlays" / name)], capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        theirs = {_ident(d): _canonical(d) for d in yaml.safe_load_all(run.stdout) if d}
        ours = {_ident(d): _canonical(d) for d in rendered[name]}
        assert theirs.keys() == ours.keys()
        for ident in theirs:
            assert theirs[ident] == ours[ident], ident


def test_build_refuses_without_secrets(tmp_path: Path) -> None:
    # No secret value is committed; without make-secrets.sh's file there is nothing to deploy.
    dest = tmp_path / "k8s"
    shutil.copytree(K8S, dest, ignore=shutil.ignore_patterns("secrets.env"))
    with pytest.raises(FileNotFoundError, match=r"secrets\.env"):
        render(dest / "overlays" / "cpu")
    git = shutil.which("git")
    tracked = (
        subprocess.run(
            [git, "ls-files", "deploy/k8s"], cwd=ROOT, capture_output=True, text=True
        ).stdout.split()
        if git
        else []
    )
    if tracked:  # a git checkout: the generated file must be ignored, never tracked
        assert not any(p.endswith("secrets.env") for p in tracked)
        assert "secrets.env" in (K8S / "base" / ".gitignore").read_text().split()
    # The script will not overwrite secrets a cluster already uses.
    assert subprocess.run(["sh", str(dest / "make-secrets.sh")], capture_output=True).returncode == 0
    again = subprocess.run(["sh", str(dest / "make-secrets.sh")], capture_output=True, text=True)
    assert again.returncode != 0 and "exists" in again.stderr


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_every_manifest_is_valid_kubernetes(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    assert len(docs) >= 15
    for doc in docs:
        for version in K8S_VERSIONS:
            # strict: an unknown field (a typo) is an error, not silently dropped by the API server.
            kubernetes_validate.validate(doc, version, strict=True)
    idents = [_ident(d) for d in docs]
    assert len(idents) == len(set(idents)), "two resources share a kind and name"


def test_validation_catches_a_bad_manifest(rendered: dict[str, list[Doc]]) -> None:
    deployment = copy.deepcopy(_of(rendered["cpu"], "Deployment")["agent"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# --- what the manifests name exists -----------------------------------------------------


def _check_target(target: str) -> None:
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    assert hasattr(mod, attr), f"{module} has no {attr}"


def _check_celery(cmd: list[str]) -> str:
    _check_target(cmd[cmd.index("-A") + 1])
    if "inspect" in cmd:
        return cmd[cmd.index("-d") + 1].split("@")[0]
    queue = cmd[cmd.index("-Q") + 1]
    assert queue in ("io", "cpu", "gpu"), queue
    assert cmd[cmd.index("-n") + 1] == f"{queue}@%h"
    return queue


def _check_beat(doc: Doc, c: Doc, docs: list[Doc]) -> None:
    """Celery beat of an app that has a schedule: one pod, never two overlapping, no autoscaler;
    its schedule file on a volume of its own, which its liveness probe watches."""
    cmd = c["command"]
    assert cmd[:2] == ["celery", "-A"] and cmd[3] == "beat"
    module, _, attr = cmd[2].partition(":")
    assert getattr(importlib.import_module(module), attr).conf.beat_schedule
    assert doc["spec"]["replicas"] == 1 and doc["spec"]["strategy"]["type"] == "Recreate"
    assert doc["metadata"]["name"] not in {
        h["spec"]["scaleTargetRef"]["name"] for h in _of(docs, "HorizontalPodAutoscaler").values()
    }
    folder = os.path.dirname(cmd[cmd.index("--schedule") + 1])
    assert folder in [m["mountPath"] for m in c["volumeMounts"]]
    assert folder in c["livenessProbe"]["exec"]["command"][-1]


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_command_port_and_probe_is_real(
    rendered: dict[str, list[Doc]], app_routes: dict[str, Any], name: str
) -> None:
    docs = rendered[name]
    services = _of(docs, "Service")
    http_seen, queues = set(), set()
    beats: list[str] = []
    for doc, c in _tandem_containers(docs):
        cmd = c["command"]
        if cmd[0] == "uvicorn":
            _check_target(cmd[1])
            assert "--factory" in cmd
            svc = cmd[1].split(".")[1]
            port = int(cmd[cmd.index("--port") + 1])
            assert port == DEFAULT_PORTS[svc], f"{svc} listens on {port}"
            assert [p["containerPort"] for p in c["ports"]] == [port]
            assert c["ports"][0]["name"] == "http"
            probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert probes["readinessProbe"]["path"] == "/readyz"
            assert probes["livenessProbe"]["path"] == "/healthz"
            for probe in probes.values():
                assert probe["port"] == "http"
                status = app_routes[svc].get(probe["path"]).status_code
                assert status != 404, f"{svc} has no route {probe['path']}"
            # The Service in front of it, named as the other services' URLs name it.
            selector = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            fronts = [
                s for s in services.values() if s["spec"]["selector"]["app.kubernetes.io/name"] == selector
            ]
            assert len(fronts) == 1, f"{svc}: {len(fronts)} Services"
            assert fronts[0]["spec"]["ports"][0]["port"] == port
            assert fronts[0]["spec"]["ports"][0]["targetPort"] == "http"
            http_seen.add(svc)
        elif "beat" in cmd:
            _check_beat(doc, c, docs)
            beats.append(doc["metadata"]["name"])
        else:
            queue = _check_celery(cmd)
            probe = c["livenessProbe"]["exec"]["command"]
            assert probe[:2] == ["sh", "-c"]
            probe_cmd = shlex.split(probe[2])
            assert probe_cmd[0] == "celery" and _check_celery(probe_cmd) == queue
            assert probe_cmd[probe_cmd.index("-d") + 1] == f"{queue}@$HOSTNAME"
            queues.add(queue)
    assert http_seen == set(DEFAULT_PORTS)
    assert queues == ({"io", "cpu", "gpu"} if name == "gpu" else {"io", "cpu"})
    assert beats == ["retrieval-beat"]
    redis = _of(docs, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["command"] == ["redis-server"]
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert redis["readinessProbe"]["exec"]["command"][0] == "redis-cli"


def _container_env(doc: Doc, c: Doc, configmaps: dict[str, Doc], secret: dict[str, str]) -> dict[str, str]:
    """The environment Kubernetes gives the container (envFrom first, then env)."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]]["data"])
        else:
            assert source["secretRef"]["name"] == "tandem-secrets"
            env.update(secret)
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "tandem-secrets"
            env[item["name"]] = secret[ref["key"]]
    return env


def _settings_for(cmd: list[str]) -> list[type[BaseSettings]]:
    classes = dict(settings_classes())
    target = cmd[1] if cmd[0] == "uvicorn" else cmd[cmd.index("-A") + 1]
    return [classes["common"], classes[target.split(".")[1]]]


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_setting_exists_and_parses(
    rendered: dict[str, list[Doc]], secret_env: dict[str, str], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered[name]
    known = {v.name for v in all_env_vars()}
    configmaps = _of(docs, "ConfigMap")
    for cm in configmaps.values():
        named = set(cm["data"])
        assert named <= known, f"ConfigMap {cm['metadata']['name']}: {sorted(named - known)}"
    secret = {
        k: base64.b64decode(v).decode() for k, v in _of(docs, "Secret")["tandem-secrets"]["data"].items()
    }
    assert secret == secret_env
    assert {k for k in secret if k.startswith("TANDEM_")} <= known
    checked = 0
    for doc, c in _tandem_containers(docs):
        env = _container_env(doc, c, configmaps, secret)
        names = {k for k in env if k.startswith("TANDEM_")}
        assert names <= known, f"{doc['metadata']['name']}: {sorted(names - known)}"
        # Start-up would load exactly these: every value must parse and nothing be unknown.
        for var in [v for v in os.environ if v.startswith("TANDEM_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        classes = _settings_for(c["command"])
        for cls in classes:
            load_settings(cls, check_unknown=False)
        check_unknown_env(*classes[1:])
        checked += 1
    assert checked >= 6
    # The URLs the services use to reach each other name real Services and ports.
    services = _of(docs, "Service")
    cfg = configmaps["tandem-config"]["data"]
    for var in ("TANDEM_INFERENCE_URL", "TANDEM_RETRIEVAL_URL", "TANDEM_TRAINER_URL", "TANDEM_AGENT_URL"):
        host, port = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", cfg[var]).groups()  # type: ignore[union-attr]
        assert host in services and services[host]["spec"]["ports"][0]["port"] == int(port), var
    host = re.fullmatch(r"redis://:[0-9a-f]+@([a-z0-9-]+):6379/0", secret["TANDEM_REDIS_URL"])
    assert host is not None and host.group(1) in services
    assert secret["TANDEM_REDIS_URL"].startswith(f"redis://:{secret['REDIS_PASSWORD']}@")


def test_a_misspelt_setting_would_stop_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the test above relies on: a TANDEM_ name no settings class reads is refused.
    monkeypatch.setenv("TANDEM_INFERENCE_ENGIN", "vllm")
    classes = dict(settings_classes())
    with pytest.raises(SettingsError, match="TANDEM_INFERENCE_ENGIN"):
        check_unknown_env(classes["inference"])


# --- storage, scaling, security, GPUs ---------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_volumes_autoscalers_and_security(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    pvcs = _of(docs, "PersistentVolumeClaim")
    assert {"models", "retrieval-data", "trainer-data"} <= set(pvcs)
    deployments = _of(docs, "Deployment")
    cfg = _of(docs, "ConfigMap")["tandem-config"]["data"]
    for doc in [*deployments.values(), *_of(docs, "StatefulSet").values()]:
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "requests" in c["resources"]
        for vol in pod.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs
    # The models volume is mounted where TANDEM_MODEL_ROOTS lets paths point.
    for _doc, c in _tandem_containers(docs):
        for m in c.get("volumeMounts", []):
            if m["name"] == "models":
                assert m["mountPath"] in cfg["TANDEM_MODEL_ROOTS"].split(":")
    # Redis keeps its AOF on its own claim.
    redis = _of(docs, "StatefulSet")["redis"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    hpas = _of(docs, "HorizontalPodAutoscaler")
    expected = {"inference", "retrieval-worker", "trainer-worker-cpu"} | (
        {"trainer-worker-gpu"} if name == "gpu" else set()
    )
    assert set(hpas) == expected
    for hpa in hpas.values():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        # Utilisation is measured against requests: a container without a CPU request never scales.
        for c in deployments[target["name"]]["spec"]["template"]["spec"]["containers"]:
            assert "cpu" in c["resources"]["requests"]


def test_gpu_overlay_requests_gpus_and_cpu_overlay_none(rendered: dict[str, list[Doc]]) -> None:
    def gpus(docs: list[Doc]) -> dict[str, str]:
        return {
            doc["metadata"]["name"]: c["resources"]["limits"]["nvidia.com/gpu"]
            for doc, c in _containers(docs)
            if "nvidia.com/gpu" in c["resources"].get("limits", {})
        }

    assert gpus(rendered["cpu"]) == {}
    assert gpus(rendered["gpu"]) == {"inference": "1", "trainer-worker-gpu": "1"}
    gpu = _of(rendered["gpu"], "Deployment")
    for name in ("inference", "trainer-worker-gpu"):
        c = gpu[name]["spec"]["template"]["spec"]["containers"][0]
        assert c["image"].startswith("tandem-gpu:")
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    env = {
        e["name"]: e["value"] for e in gpu["inference"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TANDEM_INFERENCE_ENGINE"] == "vllm"
    cpu_inf = _of(rendered["cpu"], "Deployment")["inference"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in cpu_inf["env"]}["TANDEM_INFERENCE_ENGINE"] == "torch"
    assert _of(rendered["cpu"], "ConfigMap")["tandem-config"]["data"]["TANDEM_DEVICE"] == "cpu"


# --- images --------------------------------------------------------------------------------


def _dockerfile(path: str) -> tuple[list[str], str | None]:
    """The FROM images (ARG defaults substituted) and the last USER of a Dockerfile."""
    text = (ROOT / path).read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    froms = [
        re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f) for f in re.findall(r"^FROM (\S+)", text, re.M)
    ]
    users = re.findall(r"^USER (\S+)", text, re.M)
    return froms, users[-1] if users else None


def test_images_are_pinned_and_run_as_a_user() -> None:
    for path in ("docker/Dockerfile", "docker/Dockerfile.gpu"):
        froms, user = _dockerfile(path)
        assert froms, path
        for image in froms:
            tag = image.rpartition(":")[2] if ":" in image else ""
            assert tag and tag != "latest", f"{path}: FROM {image} is not pinned"
        assert user not in (None, "root", "0"), f"{path} runs as {user}"
    froms, user = _dockerfile("docker/Dockerfile.gpu")
    # The vLLM line services/inference/engine/vllm_engine.py is written against (see the Dockerfile).
    assert re.fullmatch(r"vllm/vllm-openai:v0\.12\.\d+", froms[0])
    assert user == "1000"


def test_observability_overlay(k8s_copy: Path) -> None:
    """The CPU stack plus a Collector and Jaeger: valid Kubernetes, every Tandem container
    sends spans to the collector's Service, and the collector to Jaeger's."""
    docs = render(k8s_copy / "overlays" / "observability")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    services = _of(docs, "Service")
    assert {"otel-collector", "jaeger"} <= set(services)
    tandem = list(_tandem_containers(docs))
    assert len(tandem) == len(list(_tandem_containers(render(k8s_copy / "overlays" / "cpu"))))
    for doc, c in tandem:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", endpoint).groups()  # type: ignore[union-attr]
        assert host == "otel-collector", doc["metadata"]["name"]
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    config = yaml.safe_load(_of(docs, "ConfigMap")["otel-collector-config"]["data"]["config.yaml"])
    jaeger_host, jaeger_port = config["exporters"]["otlp/jaeger"]["endpoint"].split(":")
    assert int(jaeger_port) in {p["port"] for p in services[jaeger_host]["spec"]["ports"]}
    for _, c in _containers(docs):
        assert c["image"].rpartition(":")[2] not in ("", "latest"), c["image"]
