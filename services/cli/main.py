"""``tandem``: start and stop the embedded stack, manage API keys, users and read the audit log,
run evaluations."""

from __future__ import annotations

import asyncio
import getpass
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from services.cli import stack
from services.cli import stack_processes as processes
from services.cli.eval_rag import rag_command
from services.cli.eval_retrieval import retrieval_command
from services.cli.people import audit_command, last_admin_refusal, users_app
from services.cli.reader import reader_app
from services.cli.supervise import SupervisedState, error_line, read_state
from services.common import lockcheck
from services.common.audit import Actor, AuditLog
from services.common.auth import ADMIN, KeyStore
from services.common.config import SERVICE_NAMES, CommonSettings, SettingsError, load_settings
from services.common.errors import TandemError
from services.common.platforms import PlatformError, detect_platform
from services.common.redis_conn import async_redis, redis_reachable, sync_redis

app = typer.Typer(help="Tandem: RAG, agents and fine-tuning, as one stack.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (stored hashed in Redis).", no_args_is_help=True)
eval_app = typer.Typer(help="Evaluations against a running stack.", no_args_is_help=True)
config_app = typer.Typer(help="Configuration: every TANDEM_ variable.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(eval_app, name="eval")
eval_app.command("rag")(rag_command)
eval_app.command("retrieval")(retrieval_command)
app.add_typer(config_app, name="config")
app.add_typer(reader_app, name="reader")
app.add_typer(users_app, name="users")
app.command("audit")(audit_command)
console = Console()


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def _settings() -> CommonSettings:
    """Common settings, plus a check of every service's settings so mistakes surface before start."""
    try:
        common = load_settings(CommonSettings, check_unknown=False)
        classes = []
        for svc in SERVICE_NAMES:
            module = importlib.import_module(f"services.{svc}.config")
            cls = getattr(module, f"{svc.capitalize()}Settings")
            load_settings(cls, check_unknown=False)
            classes.append(cls)
        from services.common.config import check_unknown_env

        check_unknown_env(*classes)
    except SettingsError as exc:
        _fail(str(exc))
    return common


def _check_installed() -> None:
    """Stop on a package the lock names that is missing; warn in one line on versions that differ."""
    drift = lockcheck.check()
    if drift is None:
        return
    if drift.error():
        _fail(drift.error())
    if drift.warning():
        console.print(f"[yellow]warning:[/] {drift.warning()}")


def _redis_url(layout: stack.Layout, common: CommonSettings) -> str:
    try:
        return str(json.loads(layout.state_file.read_text())["redis_url"])
    except (OSError, ValueError, KeyError):
        return common.redis_url


def _stack_state(layout: stack.Layout) -> tuple[dict[str, object], str | None]:
    """``run/stack.json`` (what `tandem up` recorded), and a line saying why it is not usable."""
    try:
        data = json.loads(layout.state_file.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError):
        return {}, f"{layout.state_file} does not parse: ignored (the next `tandem up` writes it again)"
    if not isinstance(data, dict):
        return {}, f"{layout.state_file} does not hold an object: ignored"
    return data, None


def _say_notes(observed: dict[str, processes.Observed], *extra: str | None) -> None:
    for line in [*(n for ob in observed.values() for n in ob.notes), *(e for e in extra if e)]:
        console.print(f"[yellow]note:[/] {escape(line)}", highlight=False, soft_wrap=True)


@app.command()
def up(
    foreground: bool = typer.Option(False, "--foreground", help="Stay attached; Ctrl-C stops the stack."),
    timeout: float = typer.Option(600.0, help="Seconds to wait for every component to be ready."),
) -> None:
    """Start Redis (embedded Valkey unless TANDEM_REDIS_URL is set), the four services and the workers.
    On a stack of which some components run, start only those missing."""
    _check_installed()
    common = _settings()
    layout = stack.Layout(common.home_dir)
    layout.make()
    observed = processes.observe(layout)
    _, stack_note = _stack_state(layout)
    _say_notes(observed, stack_note)
    running = {n for n, ob in observed.items() if ob.running}
    try:
        platform = detect_platform(common.device)
        password = "" if common.redis_url_given else stack.ensure_redis_password(layout)
        redis_url, embedded = stack.redis_url_for(common, password)
        if not embedded:  # a Redis other machines may share: their TANDEM_HOME must be this one
            stack.check_shared_home(redis_url, layout.home)
        comps = stack.plan(common, embedded, platform.queue, layout.redis_conf if embedded else None)
        missing = [c for c in comps if c.name not in running]
        if running and not missing:
            console.print(
                f"Tandem is already running in {layout.home} ({', '.join(sorted(running))}); "
                "see `tandem status`, or `tandem down` to stop it."
            )
            return
        if running:
            console.print(
                f"Tandem runs in part in {layout.home}: starting {', '.join(c.name for c in missing)} "
                f"(running: {', '.join(sorted(running))})"
            )
        leftovers = {n for n, ob in observed.items() if not ob.running}
        if leftovers:  # a component left without its supervisor holds its port: stop it first
            report = processes.stop(
                layout, say=lambda m: console.print(f"  {m}"), only=leftovers, observed=observed
            )
            for entry in report.left:
                console.print(f"  [red]could not stop {entry}[/]")
        stack.check_ports(common, missing)
    except (stack.StackError, PlatformError) as exc:
        _fail(str(exc))
    env = {
        **os.environ,
        "TANDEM_HOME": str(layout.home),
        "TANDEM_REDIS_URL": redis_url,
        "PYTHONUNBUFFERED": "1",
    }
    if not running:
        console.print(f"Starting Tandem in [bold]{layout.home}[/] on [bold]{platform.device_type}[/]")
    try:
        _start(layout, missing, env, redis_url, timeout)
    except (stack.StackError, KeyboardInterrupt) as exc:
        console.print(f"[bold red]start-up failed:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        # what this start began goes; components that were running are left as they are
        processes.stop(layout, say=lambda m: console.print(f"  {m}"), only={c.name for c in missing})
        raise typer.Exit(1) from None
    # 0600: the Redis URL in it carries the password
    stack.write_secret(
        layout.state_file,
        json.dumps(
            {
                "redis_url": redis_url,
                "embedded_redis": embedded,
                "urls": {c.name: c.url for c in comps if c.url},
                "ports": {c.name: c.port for c in comps if c.port},
            }
        ),
    )
    _bootstrap_docs(layout, common)
    _print_urls(layout, comps, redis_url)
    if foreground:
        _wait_for_signal(layout)


class StartFailed(stack.StackError):
    pass


def _start(
    layout: stack.Layout, comps: list[stack.Component], env: dict[str, str], redis_url: str, timeout: float
) -> None:
    redis_comp = next((c for c in comps if c.name == "redis"), None)
    if redis_comp is not None:
        stack.start_component(layout, redis_comp, env)
        deadline = time.monotonic() + 20
        while not redis_reachable(redis_url):
            if time.monotonic() > deadline or _start_error(layout, "redis"):
                raise _failed(layout, "redis", "embedded Valkey did not answer")
            time.sleep(0.2)
        processes.clear_error(layout, "redis")
    _ensure_keys(layout, redis_url, env)
    others = [c for c in comps if c.name != "redis"]
    for comp in others:
        stack.start_component(layout, comp, env)
    status = {c.name: "starting" for c in others}
    shown: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    with Live(_status_table(status), console=console, refresh_per_second=4, transient=True) as live:
        while any(v != "ready" for v in status.values()):
            if not console.is_terminal:
                # No live table in logs and CI: one line per change of state instead.
                for name, state in status.items():
                    if shown.get(name) != state:
                        console.print(f"  {name}: {state}")
                        shown[name] = state
            for comp in others:
                if status[comp.name] == "ready":
                    continue
                if _start_error(layout, comp.name):
                    # its supervisor would restart it, but a component that cannot start is a
                    # configuration error to report, not to retry for ever
                    raise _failed(layout, comp.name, "exited during start-up")
                if comp.url:
                    ok, detail = stack.http_ready(comp.url)
                else:
                    ok, detail = stack.worker_ready(redis_url, comp.queue or "cpu", timeout=1.0)
                status[comp.name] = "ready" if ok else detail
                if ok:
                    processes.clear_error(layout, comp.name)
            live.update(_status_table(status))
            if time.monotonic() > deadline:
                waiting = {k: v for k, v in status.items() if v != "ready"}
                raise stack.StackError(f"not ready after {timeout:.0f}s: {waiting}")
            time.sleep(0.5)


def _start_error(layout: stack.Layout, name: str) -> bool:
    """Whether ``name`` ended during start-up: its supervisor is gone or restarted it."""
    pid = stack.read_pid(layout.pid_file(name))
    supervised = read_state(layout.supervised_state(name))
    return pid is None or not stack.pid_alive(pid) or bool(supervised and supervised.restarts)


def _failed(layout: stack.Layout, name: str, what: str) -> StartFailed:
    """The one line that says why ``name`` did not start (kept for `tandem status`)."""
    supervised = read_state(layout.supervised_state(name))
    why = (
        supervised.last_error
        if supervised and supervised.last_error
        else error_line(_tail(layout.log_file(name), 200))
    )
    processes.record_error(layout, name, why or what, time.time())
    return StartFailed(f"{name} {what}: {why or 'no error in its log'} (log: {layout.log_file(name)})")


def _bootstrap_docs(layout: stack.Layout, common: CommonSettings) -> None:
    """First start: a `docs` collection of the project's own documentation for tenant `default`,
    so a newcomer can ask questions at once. Does nothing when the collection exists."""
    from services.cli.bootstrap_docs import BootstrapError, ensure_docs_collection

    try:
        made = ensure_docs_collection(common.url_of("retrieval"), layout.key_file.read_text().strip())
        if made.created:
            console.print(f"Created collection [bold]docs[/] from {len(made.documents)} documentation files")
    except (BootstrapError, httpx.HTTPError, OSError) as exc:
        console.print(f"[yellow]docs collection not created:[/] {exc}")


def _status_table(status: dict[str, str]) -> Table:
    table = Table(title="waiting for readiness")
    table.add_column("component")
    table.add_column("state")
    for name, state in status.items():
        table.add_row(name, f"[green]{state}[/]" if state == "ready" else f"[yellow]{state}[/]")
    return table


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _ensure_keys(layout: stack.Layout, redis_url: str, env: dict[str, str]) -> None:
    """First start: an API key for tenant `default`, printed once and kept in a 0600 file;
    plus a key the services present when they call each other on their own behalf."""
    store = KeyStore(sync_redis(redis_url))
    if not layout.key_file.exists():
        key, _ = store.create("default", name="created by tandem up", role=ADMIN)
        _write_secret(layout.key_file, key)
        console.print(f"Created an API key for tenant [bold]default[/]: [bold cyan]{key}[/]")
        console.print(f"  (shown once; it is also in {layout.key_file}, readable only by you)")
    service_key_file = layout.home / "service-key"
    if not service_key_file.exists():
        # an operator key: the trainer publishes fine-tunes (for their tenants) with it
        key, _ = store.create("system", name="service-to-service", operator=True)
        _write_secret(service_key_file, key)
    else:
        # a service key made before roles existed becomes an operator key
        store.make_operator(service_key_file.read_text().strip())
    if not env.get("TANDEM_SERVICE_API_KEY"):
        env["TANDEM_SERVICE_API_KEY"] = service_key_file.read_text().strip()


def _write_secret(path: Path, value: str) -> None:
    stack.write_secret(path, value)


def _print_urls(layout: stack.Layout, comps: list[stack.Component], redis_url: str) -> None:
    console.print("[bold green]Tandem is up.[/]")
    for comp in comps:
        if comp.url:
            extra = "  (web front end)" if comp.name == "agent" else ""
            console.print(f"  {comp.name:<10} {comp.url}{extra}")
    console.print(f"  {'redis':<10} {stack.redacted(redis_url)}")
    console.print(
        f"  API key in {layout.key_file}; logs in {layout.log_dir}; `tandem down` stops everything."
    )


def _wait_for_signal(layout: stack.Layout) -> None:
    stop = {"now": False}

    def handler(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    console.print("Running in the foreground; Ctrl-C stops the stack.")
    while not stop["now"]:
        time.sleep(0.5)
    processes.stop(layout, say=lambda m: console.print(f"  {m}"))


@app.command()
def worker(
    queue: str = typer.Option(
        ..., "--queue", help="The queue to serve: gpu, npu or cpu (training), io (ingestion)."
    ),
    name: str = typer.Option("", "--name", help="Celery node name (default QUEUE@hostname)."),
) -> None:
    """Join this machine to a running stack as a worker of one queue, in the foreground.

    The stack's Redis comes from TANDEM_REDIS_URL (or, on the machine that ran `tandem up`,
    from its state), and TANDEM_HOME must be the stack's shared storage (datasets,
    checkpoints, models): both are checked before the worker starts."""
    if queue not in stack.CELERY_APP_OF:
        _fail(f"--queue {queue!r} is not a queue: use one of {', '.join(stack.CELERY_APP_OF)}")
    _check_installed()
    common = _settings()
    layout = stack.Layout(common.home_dir)
    try:
        platform = detect_platform(common.device)
    except PlatformError as exc:
        _fail(str(exc))
    if queue in ("gpu", "npu") and platform.queue != queue:
        _fail(
            f"--queue {queue} needs a {queue.upper()} this machine can use; TANDEM_DEVICE={common.device} "
            f"found {platform.device_type}"
        )
    if "TANDEM_REDIS_URL" in os.environ or not layout.state_file.exists():
        if "TANDEM_REDIS_URL" not in os.environ:
            _fail(
                "set TANDEM_REDIS_URL to the stack's Redis (a worker joins a stack; `tandem up` starts one)"
            )
        redis_url = common.redis_url
    else:
        redis_url = _redis_url(layout, common)
    if not redis_reachable(redis_url):
        _fail(f"TANDEM_REDIS_URL={stack.redacted(redis_url)!r} does not answer PING")
    try:
        stack.check_shared_home(redis_url, layout.home)
    except stack.StackError as exc:
        _fail(str(exc))
    argv = stack.worker_argv(queue, name)
    console.print(
        f"worker for queue [bold]{queue}[/] on {platform.device_type}, Redis {stack.redacted(redis_url)}"
    )
    sys.stdout.flush()
    env = {
        **os.environ,
        "TANDEM_HOME": str(layout.home),
        "TANDEM_REDIS_URL": redis_url,
        "PYTHONUNBUFFERED": "1",
    }
    os.execve(argv[0], argv, env)  # the worker replaces this process: signals reach Celery itself


@app.command()
def down(
    grace: float = typer.Option(15.0, help="Seconds between SIGTERM and SIGKILL."),
) -> None:
    """Stop every process of this TANDEM_HOME's stack: supervisors, their components, and any
    component left without its supervisor."""
    common = load_settings(CommonSettings, check_unknown=False)
    layout = stack.Layout(common.home_dir)
    observed = processes.observe(layout)
    state, stack_note = _stack_state(layout)
    _say_notes(observed, stack_note)
    report = processes.stop(layout, say=lambda m: console.print(f"  {m}"), grace=grace, observed=observed)
    layout.state_file.unlink(missing_ok=True)
    for entry in report.left:
        console.print(f"[red]still running after SIGKILL:[/] {entry}")
    busy = _listening(common, state, bool(report.stopped))
    for name, port in busy:
        console.print(f"[red]port {port} ({name}) is still in use[/] by a process that is not this stack's")
    if report.hard:
        console.print(f"Killed with SIGKILL: {', '.join(report.hard)}")
    if report.stopped:
        console.print("Tandem stopped.")
    else:
        console.print(f"Nothing was running in {layout.home}.")
    if report.left or busy:
        raise typer.Exit(1)


def _listening(common: CommonSettings, state: dict[str, object], stopped: bool) -> list[tuple[str, int]]:
    """The stack's ports something still listens on: those `tandem up` recorded, else (when
    something was stopped) the settings'."""
    recorded = state.get("ports")
    if isinstance(recorded, dict):
        ports = {str(k): int(v) for k, v in recorded.items()}
    elif stopped:
        ports = {svc: common.port_of(svc) for svc in SERVICE_NAMES}
    else:
        return []
    busy = []
    for name, port in ports.items():
        host = "127.0.0.1" if name == "redis" else common.host
        if not stack.port_free(host, port):
            busy.append((name, port))
    return busy


@app.command()
def status() -> None:
    """Each component, its process and its health."""
    common = load_settings(CommonSettings, check_unknown=False)
    layout = stack.Layout(common.home_dir)
    observed = processes.observe(layout)
    state, stack_note = _stack_state(layout)
    _say_notes(observed, stack_note)
    errors = processes.load_errors(layout)
    if not any(ob.running or ob.orphaned for ob in observed.values()):
        console.print(f"Tandem is not running in {layout.home}.")
        for name, err in sorted(errors.items()):
            console.print(
                f"  last error of {name}: {err.get('error')}", markup=False, highlight=False, soft_wrap=True
            )
        raise typer.Exit(3)
    urls = state.get("urls")
    urls = {str(k): str(v) for k, v in urls.items()} if isinstance(urls, dict) else {}
    redis_url = str(state.get("redis_url", common.redis_url))
    table = Table(title=f"Tandem in {layout.home}")
    for col in ("component", "pid", "url", "health", "restarts", "last exit", "last error"):
        table.add_column(col)
    healthy = True
    names = {*observed, *urls, *(["redis"] if state.get("embedded_redis") else [])}
    for name in sorted(names):
        ob = observed.get(name, processes.Observed(name))
        supervised = ob.state
        if ob.orphaned:
            health = "[red]supervisor gone[/] (process left running; `tandem up` replaces it)"
            healthy = False
        elif not ob.running:
            health = "[red]not running[/]"
            healthy = False
        elif name == "redis":
            health = "[green]ok[/]" if redis_reachable(redis_url) else "[red]no PING[/]"
            healthy &= health == "[green]ok[/]"
        elif name in urls:
            ok, detail = stack.http_ready(urls[name])
            health = "[green]ready[/]" if ok else f"[red]{detail}[/]"
            healthy &= ok
        else:
            ok, detail = stack.worker_ready(redis_url, name.removeprefix("worker-"))
            health = "[green]ready[/]" if ok else f"[red]{detail}[/]"
            healthy &= ok
        if ob.running and supervised is not None and supervised.pid is None:
            health = "[yellow]restarting[/]"  # between runs: the supervisor waits out its backoff
            healthy = False
        pid = ob.child.pid if ob.child else (ob.supervisor.pid if ob.supervisor else None)
        last_error = (supervised.last_error if supervised else None) or errors.get(name, {}).get("error")
        table.add_row(
            name,
            str(pid or "-"),
            urls.get(name, stack.redacted(redis_url) if name == "redis" else ""),
            health,
            str(supervised.restarts) if supervised else "-",
            _last_exit(supervised),
            str(last_error or "-"),
        )
    console.print(table)
    if not healthy:
        raise typer.Exit(1)


def _last_exit(supervised: SupervisedState | None) -> str:
    if supervised is None or supervised.last_exit_at is None:
        return "-"
    at = time.strftime("%H:%M:%S", time.localtime(supervised.last_exit_at))
    return f"{supervised.last_exit_text()} at {at}"


@app.command()
def demo() -> None:
    """Show the running stack working: every service answers the key, then a search of the
    `docs` collection and a question answered from it with citations."""
    common = load_settings(CommonSettings, check_unknown=False)
    layout = stack.Layout(common.home_dir)
    if not layout.key_file.exists():
        _fail(f"no API key in {layout.key_file}; run `tandem up` first")
    key = layout.key_file.read_text().strip()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        for svc in SERVICE_NAMES:
            # every inference replica (TANDEM_INFERENCE_URLS) must answer, not just one of them
            for url in common.inference_replicas() if svc == "inference" else [common.url_of(svc)]:
                resp = httpx.get(f"{url}/v1/whoami", headers=headers, timeout=10)
                resp.raise_for_status()
                console.print(f"{svc:<10} {url} answers for tenant {resp.json()['tenant']}")
        question = "How do I start Tandem and where is the API key?"
        hits = httpx.post(
            f"{common.url_of('retrieval')}/v1/collections/docs/search",
            json={"query": question, "top_k": 3},
            headers=headers,
            timeout=60,
        )
        hits.raise_for_status()
        console.print(f"\n[bold]search[/] docs for {question!r}:")
        for hit in hits.json()["results"]:
            console.print(f"  {hit['score']:.3f}  {hit['document_id']}  {hit['text'][:70]!r}")
        answer = httpx.post(
            f"{common.url_of('agent')}/v1/pipelines/chat-documents/run",
            json={"collection": "docs", "message": question},
            headers=headers,
            timeout=300,
        )
        answer.raise_for_status()
        body = answer.json()
        how = (
            " (answered from the sources: the model's answer was not usable)"
            if body.get("kind") == "extractive"
            else ""
        )
        console.print(f"\n[bold]chat-documents[/] {question!r}{how}:")
        console.print(f"  {body['answer'].strip()}", markup=False, highlight=False)
        for cite in body.get("citations", []):
            console.print(
                f"  [{cite['index']}] {cite['title']} ({cite['document_id']}, {cite.get('kind', 'cited')})",
                markup=False,
            )
        for flag in body.get("unsupported") or []:
            console.print(f"  not in the sources: {flag['text']!r}", markup=False)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        _fail(f"the stack did not answer as expected: {exc}")
    console.print(f"\nOpen {common.url_of('agent')} and sign in with the key in {layout.key_file}.")


@keys_app.command("create")
def keys_create(
    tenant: str = typer.Option(..., "--tenant", help="Tenant the key acts for."),
    name: str = typer.Option("", "--name", help="A label to recognise the key by."),
    operator: bool = typer.Option(
        False, "--operator", help="An operator key: may load, unload and register models for every tenant."
    ),
    role: str | None = typer.Option(
        None,
        "--role",
        help="admin (sees all of the tenant's answers and feedback, trains and promotes its models) or "
        "member (sees and rates only its own answers). Default: admin for the tenant's first key, "
        "member for later ones.",
    ),
) -> None:
    """Create an API key; it is printed once and stored only as a hash."""
    if operator and role is not None:
        _fail("--role: an operator key administers every tenant; leave --role out")
    common = load_settings(CommonSettings, check_unknown=False)
    store = _key_store(common)
    try:
        key, record = store.create(tenant, name, operator=operator, role=role)
    except TandemError as exc:
        _fail(exc.message)
    _audit(common, record.tenant, "key.create", record.key_id, {"name": name, "role": record.role_label})
    console.print(f"key id {record.key_id} for tenant {record.tenant} ({record.role_label}):")
    print(key)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="Key id (or the whole key) to revoke."),
    force: bool = typer.Option(
        False, "--force", help="Revoke even the tenant's last admin (no admin key or user is left)."
    ),
) -> None:
    """Revoke a key at once, in every service. The tenant's last admin is kept unless --force."""
    common = load_settings(CommonSettings, check_unknown=False)
    store = _key_store(common)
    refusal = last_admin_refusal(store, _redis_url(stack.Layout(common.home_dir), common), key_id)
    if refusal and not force:
        _fail(refusal)
    try:
        record = store.revoke(key_id)
    except TandemError as exc:
        _fail(exc.message)
    _audit(common, record.tenant, "key.revoke", record.key_id, {"name": record.name, "forced": bool(refusal)})
    console.print(f"revoked key {record.key_id} of tenant {record.tenant}")


@keys_app.command("list")
def keys_list(tenant: str | None = typer.Option(None, "--tenant")) -> None:
    """List keys (ids and tenants; never the keys themselves)."""
    common = load_settings(CommonSettings, check_unknown=False)
    table = Table()
    for col in ("key id", "tenant", "name", "role", "created", "revoked"):
        table.add_column(col)
    for rec in _key_store(common).list(tenant):
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.created_at))
        table.add_row(rec.key_id, rec.tenant, rec.name, rec.role_label, created, "yes" if rec.revoked else "")
    console.print(table)


def _audit(common: CommonSettings, tenant: str, action: str, target: str, detail: dict[str, object]) -> None:
    """Records a change made here in the tenant's audit log, by the account running the cli."""
    try:
        who = getpass.getuser()
    except (OSError, KeyError):  # no login name (a container without one)
        who = "unknown"

    async def write() -> None:
        client = async_redis(_redis_url(stack.Layout(common.home_dir), common))
        try:
            await AuditLog.from_settings(client, common).record(
                tenant, Actor(kind="cli", id=who), action, target, detail
            )
        finally:
            await client.aclose()

    asyncio.run(write())


def _key_store(common: CommonSettings) -> KeyStore:
    url = _redis_url(stack.Layout(common.home_dir), common)
    if not redis_reachable(url):
        _fail(f"Redis at {url} does not answer; start the stack (`tandem up`) or set TANDEM_REDIS_URL")
    return KeyStore(sync_redis(url))


@config_app.command("env-example")
def config_env_example() -> None:
    """Print the .env.example body: every variable with its default and meaning."""
    from services.cli.envdoc import render_env_example

    print(render_env_example(), end="")


@config_app.command("check")
def config_check() -> None:
    """Validate the current environment's TANDEM_ variables without starting anything."""
    _settings()
    console.print("configuration ok")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
