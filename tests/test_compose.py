"""docker-compose.yml: valid against the Compose spec, every command it names exists,
and every TANDEM_ variable the code reads is documented in .env.example.

No Docker engine runs on these machines, so this is how the file is kept honest.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.cli.envdoc import all_env_vars, render_env_example

ROOT = Path(__file__).resolve().parent.parent
# Vendored (tests/data/README.md names its source) so a clean clone checks it too.
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
ENV_EXAMPLE = (ROOT / ".env.example").read_text()


def test_compose_is_valid_against_the_spec() -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.validate(COMPOSE, schema)
    # The schema does reject mistakes (so the check above means something).
    milvus = {**COMPOSE["services"]["milvus"], "profile": ["scale"]}  # misspelt key
    broken = {**COMPOSE, "services": {**COMPOSE["services"], "milvus": milvus}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_required_services_profiles_and_health() -> None:
    services = COMPOSE["services"]
    for name in (
        "redis",
        "inference",
        "retrieval",
        "agent",
        "trainer-api",
        "trainer-worker-cpu",
        "trainer-worker-gpu",
    ):
        assert name in services, name
    assert services["inference"]["profiles"] == ["cpu"]
    assert services["inference-gpu"]["profiles"] == ["gpu"] and services["trainer-worker-gpu"][
        "profiles"
    ] == ["gpu"]
    assert "inference" in services["inference-gpu"]["networks"]["default"]["aliases"]
    for gpu in ("inference-gpu", "trainer-worker-gpu"):
        devices = services[gpu]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia"
    assert "--appendonly" in services["redis"]["command"]
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
        for dep in (svc.get("depends_on") or {}).values():
            assert dep["condition"] == "service_healthy"


def test_durable_folders_are_named_volumes() -> None:
    volumes = set(COMPOSE["volumes"])
    mounted = {
        m.split(":")[0]
        for svc in COMPOSE["services"].values()
        for m in svc.get("volumes", [])
        if isinstance(m, str)
    }
    assert {"redis-data", "models", "retrieval-data", "trainer-data"} <= volumes
    assert mounted <= volumes  # no bind mounts of host folders


def _check_target(target: str) -> None:
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    assert hasattr(mod, attr), f"{module} has no {attr}"


def _commands(svc: dict[str, Any]) -> list[list[str]]:
    out = [svc["command"]] if "command" in svc else []
    test = svc.get("healthcheck", {}).get("test", [])
    if test and test[0] == "CMD":
        out.append(test[1:])
    return out


def test_every_command_and_module_exists() -> None:
    from typer.main import get_command

    from services.cli.main import app

    cli = get_command(app)
    checked = 0
    for svc in COMPOSE["services"].values():
        for cmd in _commands(svc):
            if cmd[0] == "uvicorn":
                _check_target(cmd[1])
                assert "--factory" in cmd
            elif cmd[0] == "celery":
                _check_target(cmd[cmd.index("-A") + 1])
                if "-Q" in cmd:
                    assert cmd[cmd.index("-Q") + 1] in ("cpu", "gpu", "npu", "io")
            elif cmd[0] == "tandem":
                assert cmd[1] in cli.commands  # type: ignore[attr-defined]
            else:
                # Third-party images: their own binaries (Redis, Milvus and what it needs).
                assert cmd[0] in (
                    "redis-server",
                    "redis-cli",
                    "curl",
                    "etcd",
                    "etcdctl",
                    "minio",
                    "milvus",
                    "wget",  # Jaeger, Prometheus, Grafana
                    "/otelcol-contrib",
                ), cmd
                continue
            checked += 1
    assert checked >= 8
    for dockerfile in ("docker/Dockerfile", "docker/Dockerfile.gpu"):
        assert (ROOT / dockerfile).is_file()
    for svc in COMPOSE["services"].values():
        if "build" in svc:
            assert (ROOT / svc["build"]["dockerfile"]).is_file()


def test_env_example_is_current_and_complete() -> None:
    assert render_env_example() == ENV_EXAMPLE, "regenerate: tandem config env-example > .env.example"
    documented = set(re.findall(r"\b(TANDEM_[A-Z0-9_]+)=", ENV_EXAMPLE))
    assert {v.name for v in all_env_vars()} <= documented
    # Variables named anywhere in the code (not only through settings classes).
    in_code = set()
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        in_code |= set(re.findall(r"\b(TANDEM_[A-Z0-9_]*[A-Z0-9])\b", path.read_text()))
    prefixes = {"TANDEM_INFERENCE", "TANDEM_RETRIEVAL", "TANDEM_AGENT", "TANDEM_TRAINER", "TANDEM_TEST"}
    missing = {v for v in in_code - documented if v not in prefixes and not v.startswith("TANDEM_TEST_")}
    assert not missing, f"not in .env.example: {sorted(missing)}"
    # Variables the compose file interpolates.
    compose_text = (ROOT / "docker-compose.yml").read_text()
    for var in set(re.findall(r"\$\{([A-Z0-9_]+)", compose_text)):
        assert f"{var}=" in ENV_EXAMPLE, var
    for svc in COMPOSE["services"].values():
        env = svc.get("environment") or {}
        for var in env if isinstance(env, dict) else [e.split("=")[0] for e in env]:
            if var.startswith("TANDEM_") or svc.get("image", "").startswith("tandem"):
                assert f"{var}=" in ENV_EXAMPLE, f"compose sets {var}, which no settings class reads"


def test_required_secrets_fail_loudly() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${TANDEM_SERVICE_API_KEY:?" in text
    # Redis refuses clients without the password, and every Tandem container has it.
    redis_cmd = COMPOSE["services"]["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${TANDEM_REDIS_PASSWORD:?")
    assert COMPOSE["x-tandem-env"]["TANDEM_REDIS_PASSWORD"].startswith("${TANDEM_REDIS_PASSWORD:?")
    assert "ports" not in COMPOSE["services"]["redis"]


def _active(profiles: set[str]) -> dict[str, dict[str, Any]]:
    """The services `docker compose --profile ... up` starts."""
    return {
        name: svc
        for name, svc in COMPOSE["services"].items()
        if not svc.get("profiles") or profiles & set(svc["profiles"])
    }


def _names(name: str, svc: dict[str, Any]) -> set[str]:
    aliases = ((svc.get("networks") or {}).get("default") or {}).get("aliases", [])
    return {name, *aliases}


@pytest.mark.parametrize("profiles", [{"cpu"}, {"gpu"}, {"scale"}])
def test_each_profile_is_a_whole_stack(profiles: set[str]) -> None:
    active = _active(profiles)
    for name, svc in active.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in COMPOSE["services"], f"{name} depends on unknown {dep}"
            assert dep in active or cond.get("required") is False, f"{name} needs {dep}, off in {profiles}"
    # Exactly one service answers each host name the Tandem URLs use.
    env = COMPOSE["x-tandem-env"]
    for var in ("TANDEM_INFERENCE_URL", "TANDEM_RETRIEVAL_URL", "TANDEM_TRAINER_URL", "TANDEM_AGENT_URL"):
        host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", env[var]).groups()  # type: ignore[union-attr]
        providers = [n for n, svc in active.items() if host in _names(n, svc)]
        assert len(providers) == 1, f"{profiles}: {host} is served by {providers}"
        assert f"--port {port}" in " ".join(active[providers[0]]["command"])
    assert "redis" in active and "redis" in env["TANDEM_REDIS_URL"]


def test_scale_profile() -> None:
    services = COMPOSE["services"]
    scale = {n for n, s in services.items() if "scale" in (s.get("profiles") or [])}
    assert {"milvus", "etcd", "minio", "inference-replica", "retrieval-replica"} <= scale
    for name in ("milvus", "etcd", "minio"):
        image = services[name]["image"]
        tag = image.rpartition(":")[2]
        # Versions published together by Milvus; "latest" would let any release in.
        assert ":" in image and tag != "latest" and any(ch.isdigit() for ch in tag), image
        assert "ports" not in services[name], f"{name} should not be published on the host"
        assert services[name]["volumes"][0].split(":")[0] in COMPOSE["volumes"]
    milvus = services["milvus"]
    assert milvus["command"] == ["milvus", "run", "standalone"]
    assert milvus["environment"]["ETCD_ENDPOINTS"] == "etcd:2379"
    assert milvus["environment"]["MINIO_ADDRESS"] == "minio:9000"
    assert set(milvus["depends_on"]) == {"etcd", "minio"}
    for name, alias, port in (
        ("inference-replica", "inference", 8001),
        ("retrieval-replica", "retrieval", 8002),
    ):
        svc = services[name]
        assert svc["deploy"]["replicas"] == 2
        assert alias in svc["networks"]["default"]["aliases"]
        # Two replicas cannot bind one host port.
        assert "ports" not in svc
        assert svc["command"][svc["command"].index("--port") + 1] == str(port)
        assert str(port) in svc["healthcheck"]["test"][-1]
    assert services["retrieval-replica"]["depends_on"]["milvus"]["condition"] == "service_healthy"


@pytest.mark.parametrize(
    ("profile", "backend"), [("cpu", "embedded"), ("gpu", "embedded"), ("scale", "milvus")]
)
def test_the_retrieval_api_and_its_io_worker_share_one_backend(profile: str, backend: str) -> None:
    # The API queues ingestion jobs (many documents, uploads) that the io worker writes: a worker
    # on another backend than the API's fails every job (tests/retrieval/test_milvus.py).
    retrieval = {
        name: svc
        for name, svc in _active({profile}).items()
        if "services.retrieval." in " ".join(svc.get("command", []))
    }
    assert {svc["command"][0] for svc in retrieval.values()} == {"uvicorn", "celery"}, retrieval.keys()
    for name, svc in retrieval.items():
        env = svc["environment"]
        assert env.get("TANDEM_RETRIEVAL_BACKEND", "embedded") == backend, (profile, name)
        if backend == "milvus":
            assert env["TANDEM_RETRIEVAL_MILVUS_URI"] == "http://milvus:19530", name
            assert svc["depends_on"]["milvus"]["condition"] == "service_healthy", name
            assert "retrieval-data:/data/retrieval" in svc["volumes"], name  # uploads pass through it


@pytest.mark.parametrize("profile", ["cpu", "gpu", "scale"])
def test_one_io_worker_runs_the_beat(profile: str) -> None:
    # Celery beat starts the due syncs of collections' sources (docs/retrieval.md, Sources):
    # inside one io worker of each profile, never one with replicas.
    beats = [
        name
        for name, svc in _active({profile}).items()
        if "--beat" in svc.get("command", []) or "beat" in svc.get("command", [])
    ]
    assert len(beats) == 1, beats
    svc = _active({profile})[beats[0]]
    cmd = svc["command"]
    assert cmd[cmd.index("-A") + 1] == "services.retrieval.worker:celery_app" and "io" in cmd
    assert svc.get("deploy", {}).get("replicas", 1) == 1
    schedule = cmd[cmd.index("--schedule") + 1]
    assert any(schedule.startswith(m.split(":")[1] + "/") for m in svc["volumes"])


def test_observability_profile() -> None:
    """Collector and Jaeger for traces, Prometheus and Grafana (with the dashboard) for metrics;
    their configuration files exist and say what the services need."""
    services = COMPOSE["services"]
    observed = {n for n, s in services.items() if "observability" in (s.get("profiles") or [])}
    assert observed == {"otel-collector", "jaeger", "prometheus", "grafana"}
    for name in observed:
        for ref in services[name].get("configs", []):
            assert (ROOT / COMPOSE["configs"][ref["source"]]["file"]).is_file(), ref
    env = COMPOSE["x-tandem-env"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"  # off unless set
    collector = yaml.safe_load((ROOT / "deploy/observability/otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].startswith("jaeger:")
    prometheus = yaml.safe_load((ROOT / "deploy/observability/prometheus.yml").read_text())
    targets = {
        t for job in prometheus["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]
    }
    for var in ("TANDEM_INFERENCE_URL", "TANDEM_RETRIEVAL_URL", "TANDEM_TRAINER_URL", "TANDEM_AGENT_URL"):
        assert env[var].removeprefix("http://") in targets, var
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tandem.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "tandem_retrieval_query_seconds_bucket",
        "tandem_retrieval_ingested_chunks_total",
        "tandem_trainer_tokens_per_second",
        "tandem_agent_answer_groundedness_sum",
        "tandem_agent_answers_total",
        "tandem_agent_answer_ratings_total",
    ):
        assert metric in exprs, metric
