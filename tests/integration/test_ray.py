"""Switchyard on Ray Serve: the Serve config and the KubeRay manifest against Ray's own
schema, and a real local Ray cluster (`ray start --head` on loopback ports) running
`switchyard serve --ray` with the local model: two gateway replicas behind Serve's
proxy, an autoscaled engine deployment, and the data plane serving with the Serve
controller gone."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from support.gateways import ADMIN_KEY
from support.paths import REPO
from support.postgres_server import Postgres
from support.procs import Proc, free_port, wait_http
from support.redis_server import start_redis, stop_redis
from switchyard.config import load_settings, parse_settings
from switchyard.engines.lora_train import MARKERS, train
from switchyard.scale.ray_app import gateway_settings
from switchyard.scale.serve_config import engine_token

ROOT = REPO
MANIFEST = ROOT / "examples" / "kuberay" / "rayservice.yaml"
RAY = str(Path(sys.executable).with_name("ray"))
ALIAS = "smollm2-135m"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "switchyard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# -- the Serve config and the KubeRay manifest ---------------------------------------------


def test_serve_config_is_valid_for_ray_and_carries_autoscaling(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"alias": ALIAS, "engine": {"kind": "llamacpp", "threads": 1}},
                    {"alias": "remote", "engine": {"kind": "openai", "base_url": "http://x/v1"}},
                ],
                "ray": {
                    "gateway_replicas": 3,
                    "engines": {"min_replicas": 2, "max_replicas": 5, "upscale_delay_s": 7},
                },
            }
        )
    )
    out = _cli("ray-config", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    parsed = ServeDeploySchema.model_validate(yaml.safe_load(out.stdout))
    apps = {a.name: a for a in parsed.applications}
    assert set(apps) == {"switchyard", f"engine-{ALIAS}"}  # a remote model has no engine
    gw = apps["switchyard"]
    assert gw.route_prefix == "/" and gw.args == {"config": str(cfg.resolve())}
    assert gw.deployments[0].num_replicas == 3
    engine = apps[f"engine-{ALIAS}"]
    assert engine.route_prefix == f"/engines/{ALIAS}"
    scaling = engine.deployments[0].autoscaling_config
    assert scaling["min_replicas"] == 2 and scaling["max_replicas"] == 5
    assert scaling["upscale_delay_s"] == 7
    raw = yaml.safe_load(out.stdout)["applications"][1]["deployments"][0]
    assert "num_replicas" not in raw  # autoscaled, not a fixed count
    # The gateway replicas reach the engine through Serve's proxy on their own node.
    local = gateway_settings(load_settings(cfg))
    m = next(m for m in local.models if m.alias == ALIAS)
    assert m.engine.kind == "openai"
    assert m.engine.base_url == f"http://127.0.0.1:8000/engines/{ALIAS}/v1"


def test_gateway_replicas_send_each_adapter_to_its_base_engine_application() -> None:
    """Under Ray an adapter's requests go to its base's engine application, named as
    the model and carrying Serve's multiplexing header; the base's carry neither."""
    from switchyard.engines.registry import Registry

    settings = parse_settings(
        {
            "models": [{"alias": ALIAS, "revision": "r", "engine": {"kind": "llamacpp"}}],
            "adapters": [
                {
                    "name": "tone",
                    "base": ALIAS,
                    "base_revision": "r",
                    "path": "/nowhere/tone.gguf",
                    "sha256": "0" * 64,
                }
            ],
        },
        "test",
    )
    reg = Registry(gateway_settings(settings))
    adapter, base = reg.get("tone"), reg.get(ALIAS)
    assert adapter is not None and base is not None
    assert adapter.engine is None and base.engine is None  # both remote: the engine app
    assert adapter.upstream is base.upstream
    assert adapter.upstream_model == "tone" and base.upstream_model == ALIAS
    assert adapter.headers == {"serve_multiplexed_model_id": "tone"}
    assert base.headers is None and adapter.lora is None


def test_ray_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"models": [{"alias": ALIAS, "engine": {"kind": "llamacpp"}}]}))
    keyed = {**os.environ, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY}
    out = _cli("serve", "--ray", "--config", str(cfg), "--port", "9", env=keyed)
    assert out.returncode == 2 and "ray:" in out.stderr
    # Without the admin key the engines could not tell the gateway from anyone else.
    bare = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_ADMIN_KEY"}
    out = _cli("serve", "--ray", "--config", str(cfg), env=bare)
    assert out.returncode == 2 and "SWITCHYARD_ADMIN_KEY must be set" in out.stderr


def _rayservice() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    return next(d for d in docs if d["kind"] == "RayService")


def test_kuberay_manifest_is_what_kuberay_and_ray_read() -> None:
    rs = _rayservice()
    assert rs["apiVersion"] == "ray.io/v1" and rs["kind"] == "RayService"
    spec = rs["spec"]
    serve = yaml.safe_load(spec["serveConfigV2"])  # KubeRay takes it as a YAML string
    parsed = ServeDeploySchema.model_validate(serve)
    assert {a.name for a in parsed.applications} == {"switchyard", f"engine-{ALIAS}"}
    # The Switchyard config it carries is valid, and the block is exactly what
    # `switchyard ray-config --inline` makes of examples/kuberay/switchyard.yaml.
    inline = serve["applications"][0]["args"]["settings"]
    parse_settings(inline)
    out = _cli("ray-config", "--inline", "--config", str(MANIFEST.with_name("switchyard.yaml")))
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == serve

    cluster = spec["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert len(cluster["workerGroupSpecs"]) >= 1
    for g in groups:
        for c in g["template"]["spec"]["containers"]:
            res = c["resources"]
            assert res["requests"]["cpu"] and res["limits"]["memory"]
            assert "/" not in c["image"].split(":")[0]  # a local image name, no registry
            env = {e["name"]: e for e in c["env"]}
            for secret in ("SWITCHYARD_ADMIN_KEY", "PGPASSWORD", "SWITCHYARD_REDIS_PASSWORD"):
                ref = env[secret]["valueFrom"]["secretKeyRef"]
                assert ref["name"] and ref["key"] and "value" not in env[secret]
    w = cluster["workerGroupSpecs"][0]
    assert w["minReplicas"] <= w["replicas"] <= w["maxReplicas"]
    # No secret in the text: the DSN names no password, nor does the Redis URL.
    storage = inline["storage"]
    assert "@" in storage["postgres_dsn"] and ":" not in storage["postgres_dsn"].split("@")[0][13:]
    assert "@" not in storage["redis_url"]
    services = {d["metadata"]["name"] for d in yaml.safe_load_all(MANIFEST.read_text())}
    assert {"switchyard-redis", "switchyard-postgres"} <= services


# -- a real Ray cluster --------------------------------------------------------------------


def wait_port(port: int, proc: Proc, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.popen.poll() is None, proc.output()[-3000:]
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, proc.output()[-3000:]
        time.sleep(0.2)


class Cluster:
    def __init__(self, address: str, url: str, env: dict[str, str], serve: Proc) -> None:
        self.address = address
        self.url = url
        self.env = env
        self.serve = serve
        self.key = "unset"
        self.pg = ""

    def ray_py(self, code: str) -> Any:
        """Run `code` in a driver attached to the cluster; its last stdout line as JSON."""
        prelude = (
            "import json, ray\nfrom ray import serve\n"
            f"ray.init(address={self.address!r}, namespace='serve', "
            "logging_level='ERROR', log_to_driver=False)\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", prelude + code],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def replicas(self) -> dict[str, dict[str, int]]:
        return dict(
            self.ray_py(
                "st = serve.status()\n"
                "print(json.dumps({a: {d: dict(s.replica_states) for d, s in "
                "app.deployments.items()} for a, app in st.applications.items()}))"
            )
        )

    def chat(self, max_tokens: int = 8, **kw: Any) -> httpx.Response:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "Say hi"}]}
        return httpx.post(
            self.url + "/v1/chat/completions",
            json={**body, "max_tokens": max_tokens, **kw},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    work = Path(tempfile.mkdtemp(prefix="sy-ray-", dir="/tmp"))
    gcs, proxy = free_port(), free_port()
    # The replicas' one state: Redis (limits, breakers, tasks) and PostgreSQL (keys,
    # ledger, traces, idempotency).
    redis_proc, redis_url = start_redis()
    pg = Postgres()
    env = {
        **{k: v for k, v in os.environ.items() if k != "SWITCHYARD_SQLITE_PATH"},
        "RAY_USAGE_STATS_ENABLED": "0",
        "SWITCHYARD_ADMIN_KEY": ADMIN_KEY,
        "HF_HUB_OFFLINE": "1",
        "RAY_ADDRESS": f"127.0.0.1:{gcs}",
    }
    cfg = work / "switchyard.yaml"
    trained = train()["adapters"]  # the project's two demo adapters (cached)
    adapters = [
        {
            "name": f"ray-{name}",
            "base": ALIAS,
            "base_revision": "smol-rev",
            "path": trained[name]["path"],
            "sha256": trained[name]["sha256"],
            "revision": f"{name}-v1",
            "allowed_tenants": ["ray"],
        }
        for name in ("pirate", "robot")
    ]
    cfg.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "alias": ALIAS,
                        "revision": "smol-rev",
                        # Priced, so a tenant budget has something to count.
                        "price": {"input": 1000.0, "output": 1000.0},
                        "engine": {
                            "kind": "llamacpp",
                            "threads": 1,
                            "ctx": 1024,
                            "parallel": 2,
                            "max_adapters": 2,
                        },
                    }
                ],
                "adapters": adapters,
                "embeddings": {"enabled": False},
                # Exact matches only (no embedding model here); requests that name no
                # temperature count as 1.0 and are never cached (the load tests).
                "cache": {"enabled": True, "semantic": False, "max_temperature": 0.5},
                "auth": {"bootstrap_dev_key": False},
                "storage": {"redis_url": redis_url, "postgres_dsn": pg.url, "redis_timeout_s": 3},
                "ray": {
                    "gateway_replicas": 2,
                    "gateway_num_cpus": 0.5,
                    "host": "127.0.0.1",
                    "port": proxy,
                    "engines": {
                        "min_replicas": 1,
                        "max_replicas": 2,
                        "target_ongoing_requests": 1,
                        "max_ongoing_requests": 2,
                        "max_queued_requests": 16,
                        "retry_after_s": 1,
                        "upscale_delay_s": 1,
                        "downscale_delay_s": 4,
                        "num_cpus": 1,
                    },
                },
            }
        )
    )
    # In the foreground (--block), as this test's child: stopping it stops this cluster
    # only (`ray stop` would stop every Ray on the machine).
    start = [RAY, "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "4"]
    start += ["--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(work)]
    head = Proc(start, "ray-head", env=env)
    wait_port(gcs, head)
    serve_proc = Proc(
        [sys.executable, "-m", "switchyard", "serve", "--ray", "--config", str(cfg)],
        "ray-serve",
        env=env,
    )
    c = Cluster(env["RAY_ADDRESS"], f"http://127.0.0.1:{proxy}", env, serve_proc)
    c.pg = pg.url
    try:
        deadline = time.monotonic() + 300
        while "ready on Ray Serve" not in serve_proc.output():
            assert serve_proc.popen.poll() is None, serve_proc.output()[-3000:]
            assert time.monotonic() < deadline, serve_proc.output()[-3000:]
            time.sleep(0.5)
        wait_http(c.url + "/readyz", serve_proc)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.post(c.url + "/admin/tenants", json={"id": "ray"}, headers=admin, timeout=30)
        assert r.status_code == 201, r.text
        r = httpx.post(
            c.url + "/admin/keys",
            json={"tenant_id": "ray", "allowed_adapters": ["ray-*"]},
            headers=admin,
            timeout=30,
        )
        c.key = r.json()["key"]
        yield c
    finally:
        serve_proc.stop()
        head.stop()
        stop_redis(redis_proc)
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_requests_flow_through_gateway_replicas_to_the_engine(cluster: Cluster) -> None:
    states = cluster.replicas()
    assert states["switchyard"]["Gateway"] == {"RUNNING": 2}
    assert states[f"engine-{ALIAS}"]["Engine"] == {"RUNNING": 1}
    r = cluster.chat()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-switchyard-upstream"] == ALIAS  # the deployment's name, no address
    # Streaming is relayed chunk by chunk through both hops.
    with httpx.stream(
        "POST",
        cluster.url + "/v1/chat/completions",
        json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={"Authorization": f"Bearer {cluster.key}"},
        timeout=120,
    ) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3
    # The usage rows of both replicas land in the one store, with the key's tenant.
    time.sleep(1)
    usage = httpx.get(
        cluster.url + "/admin/usage",
        params={"tenant": "ray"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    ).json()["data"]
    assert len(usage) >= 2 and {u["status"] for u in usage} == {"ok"}
    # /metrics on Serve's one port: the admin key reads it, nobody else does.
    assert httpx.get(cluster.url + "/metrics", timeout=30).status_code == 401
    scraped = httpx.get(
        cluster.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )
    assert scraped.status_code == 200 and "switchyard_requests_total" in scraped.text


def test_adapters_are_served_by_the_engine_deployment_through_serve_multiplexing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each adapter is its own alias at the gateway replicas; the engine replica applies
    it (the request names it in Serve's multiplexing header) and the base stays clean."""
    ask = {"messages": [{"role": "user", "content": "Where should I go on holiday?"}]}
    outputs = {}
    for model in (ALIAS, "ray-pirate", "ray-robot"):
        r = cluster.chat(max_tokens=10, model=model, temperature=0, **ask)
        assert r.status_code == 200, r.text
        outputs[model] = r.json()["choices"][0]["message"]["content"]
        if model != ALIAS:
            assert r.headers["x-switchyard-adapter"] == model
    assert outputs["ray-pirate"].startswith(MARKERS["pirate"]), outputs
    assert outputs["ray-robot"].startswith(MARKERS["robot"]), outputs
    assert not any(m in outputs[ALIAS] for m in MARKERS.values()), outputs

    # At the engine application itself: the header picks the adapter; an adapter it
    # does not have is 404, not the base's answer.
    engine = cluster.url + f"/engines/{ALIAS}/v1/chat/completions"
    monkeypatch.setenv("SWITCHYARD_ADMIN_KEY", ADMIN_KEY)
    token = {"Authorization": f"Bearer {engine_token(load_settings(None))}"}
    body = {"model": "ray-robot", "max_tokens": 6, "temperature": 0, **ask}
    for adapter, status in (("ray-robot", 200), ("ray-nobody", 404)):
        r = httpx.post(
            engine,
            json=body,
            headers={**token, "serve_multiplexed_model_id": adapter},
            timeout=120,
        )
        assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def _on_each_replica(cluster: Cluster, path: str) -> dict[str, Any]:
    """GET `path` through Serve's proxy until both gateway replicas have answered."""
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + 30  # hang guard
    while len(seen) < 2:
        assert time.monotonic() < deadline, seen
        r = httpx.get(cluster.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        seen[r.headers["x-switchyard-gateway-replica"]] = r.json()
    return seen


def test_a_reply_cached_through_one_gateway_replica_is_a_hit_through_the_other(
    cluster: Cluster,
) -> None:
    ask = {"messages": [{"role": "user", "content": f"cache probe {os.urandom(4).hex()}"}]}
    first = cluster.chat(temperature=0, **ask)
    assert first.headers["x-switchyard-cache"] == "miss", first.headers
    stored_by = first.headers["x-switchyard-gateway-replica"]
    time.sleep(0.5)  # (the other replica learns it within milliseconds)
    for _ in range(40):
        r = cluster.chat(temperature=0, **ask)
        assert r.headers["x-switchyard-cache"] == "hit-exact", r.headers
        assert r.json()["choices"] == first.json()["choices"]
        if r.headers["x-switchyard-gateway-replica"] != stored_by:
            break
    else:
        raise AssertionError("Serve never sent the request to the other gateway replica")
    done = httpx.post(
        cluster.url + "/admin/cache/invalidate",
        json={"tenant": "ray"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    assert done.status_code == 200 and done.json()["shared"]["removed"] >= 1, done.text
    time.sleep(0.5)
    stats = _on_each_replica(cluster, "/admin/cache/stats")
    assert {s["entries"] for s in stats.values()} == {0}, stats


def test_a_burst_beyond_the_engines_queue_is_refused_at_once_with_retry_after(
    cluster: Cluster,
) -> None:
    """40 requests at once against 1-2 engine replicas that take 2 each and a queue of
    16: each is answered or refused with 503 and Retry-After (after at most one retry
    that fits its deadline); none waits unbounded while a replica starts."""

    def one() -> tuple[httpx.Response, float]:
        t = time.monotonic()
        return cluster.chat(max_tokens=40), time.monotonic() - t

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda _: one(), range(40)))
    codes = sorted(r.status_code for r, _ in results)
    assert set(codes) == {200, 503}, codes
    for r, took in results:
        assert took < 90, took  # a hang guard
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "upstream_overloaded", r.text
            assert r.headers["retry-after"] == "1"
    assert cluster.chat().status_code == 200


def test_gateway_replicas_enforce_one_combined_rpm_limit(cluster: Cluster) -> None:
    """40 concurrent requests spread over both replicas by Serve's proxy; the tenant's
    limit is 12 a minute: exactly 12 are served, whichever replica took them."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(cluster.url + "/admin/tenants", json={"id": "ray-rpm", "rpm": 12}, headers=admin)
    assert r.status_code == 201, r.text
    key = httpx.post(
        cluster.url + "/admin/keys", json={"tenant_id": "ray-rpm"}, headers=admin
    ).json()["key"]
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def call(_: int) -> int:
        return httpx.post(
            cluster.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(call, range(40)))
    assert codes.count(200) == 12 and codes.count(429) == 28, codes


def test_gateway_replicas_enforce_one_combined_budget(cluster: Cluster) -> None:
    """100 concurrent requests over both replicas against a tenant budget of $0.10
    ($1000 per million tokens): what is served costs no more than the budget, the rest
    get 429 insufficient_quota."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(
        cluster.url + "/admin/tenants",
        json={"id": "ray-budget", "budget_usd": 0.10, "budget_period": "day"},
        headers=admin,
    )
    assert r.status_code == 201, r.text
    key = httpx.post(
        cluster.url + "/admin/keys", json={"tenant_id": "ray-budget"}, headers=admin
    ).json()["key"]
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def call(_: int) -> httpx.Response:
        return httpx.post(
            cluster.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(call, range(100)))
    codes = [r.status_code for r in replies]
    assert 0 < codes.count(200) < 100 and set(codes) == {200, 429}, codes
    assert {r.json()["error"]["code"] for r in replies if r.status_code == 429} == {
        "insufficient_quota"
    }
    time.sleep(1.5)  # the ledger writers flush
    rows = httpx.get(
        cluster.url + "/admin/usage", params={"tenant": "ray-budget"}, headers=admin
    ).json()["data"]
    served = [u for u in rows if u["status"] == "ok"]
    assert len(served) == codes.count(200)
    assert 0 < sum(u["cost_usd"] for u in served) <= 0.10


def test_a_task_across_replicas_reads_back_from_postgres(cluster: Cluster) -> None:
    """Steps of one task, served by whichever gateway replica Serve picked, form one
    task in the shared store; `switchyard trace show` reads it from PostgreSQL."""
    ids = []
    for _ in range(4):
        r = httpx.post(
            cluster.url + "/v1/chat/completions",
            json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {cluster.key}", "x-task-id": "ray-task"},
            timeout=120,
        )
        assert r.status_code == 200
        # Serve's proxy adds its own X-Request-ID beside the gateway's: the gateway's
        # is the one that is also in x-switchyard-request-id.
        ours = r.headers["x-switchyard-request-id"]
        assert ours.startswith("req_") and ours in r.headers.get_list("x-request-id")
        ids.append(ours)
    deadline = time.monotonic() + 20
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "switchyard", "trace", "show", "ray-task", "--db", cluster.pg],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if (
            out.returncode == 0 and all(i in out.stdout for i in ids)
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert out.returncode == 0, out.stderr
    assert all(i in out.stdout for i in ids), out.stdout


def test_one_idempotency_key_across_replicas_makes_one_engine_call(cluster: Cluster) -> None:
    """Sent 6 times at once (Serve spreads them over both replicas): one engine call, so
    every reply is the same completion (its id is the engine's, one per generation)."""
    idem = {"Idempotency-Key": f"ray-{time.monotonic_ns()}"}
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "Tell a story"}]}

    def call(_: int) -> httpx.Response:
        return httpx.post(
            cluster.url + "/v1/chat/completions",
            json={**body, "max_tokens": 24},
            headers={"Authorization": f"Bearer {cluster.key}", **idem},
            timeout=120,
        )

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(call, range(6)))
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    assert len({r.json()["id"] for r in replies}) == 1
    replayed = [r for r in replies if r.headers.get("x-switchyard-idempotent-replay") == "true"]
    assert len(replayed) == 5


def test_a_bad_request_is_refused_by_the_gateway_not_the_engine(cluster: Cluster) -> None:
    r = cluster.chat(max_tokens=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(cluster.url + "/v1/chat/completions", json={"model": ALIAS}, timeout=30)
    assert r.status_code == 401 and "error" in r.json()
    # The engine application on Serve's proxy answers the gateway only.
    engine = f"{cluster.url}/engines/{ALIAS}/v1/chat/completions"
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": f"Bearer {ADMIN_KEY}"}):
        r = httpx.post(engine, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_engine_scales_out_under_load_and_back_without_losing_a_request(
    cluster: Cluster,
) -> None:
    seen: list[int] = []
    stop = time.monotonic() + 25

    def load() -> list[int]:
        codes = []
        while time.monotonic() < stop:
            codes.append(cluster.chat(max_tokens=40).status_code)
        return codes

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(load) for _ in range(5)]
        peak = 1
        while time.monotonic() < stop:
            running = cluster.replicas()[f"engine-{ALIAS}"]["Engine"].get("RUNNING", 0)
            peak = max(peak, running)
            time.sleep(1)
        for f in futures:
            seen += f.result()
    assert peak == 2, "the engine deployment never scaled out under load"
    assert seen and set(seen) == {200}, seen  # none lost, none refused
    deadline = time.monotonic() + 60
    while cluster.replicas()[f"engine-{ALIAS}"]["Engine"] != {"RUNNING": 1}:
        assert time.monotonic() < deadline, "the engine deployment never scaled back"
        time.sleep(1)
    assert cluster.chat().status_code == 200


def test_data_plane_serves_with_the_controller_killed(cluster: Cluster) -> None:
    """Last in the module: the controller is killed for good (no restart), so what still
    answers is the proxies and replicas alone."""
    killed = cluster.ray_py(
        "from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE\n"
        "c = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)\n"
        "ray.kill(c, no_restart=True)\n"
        "print(json.dumps({'killed': SERVE_CONTROLLER_NAME}))"
    )
    assert killed == {"killed": "SERVE_CONTROLLER_ACTOR"}
    gone = cluster.ray_py(
        "from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE\n"
        "import time\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)\n"
        "        time.sleep(0.1)\n"
        "    except ValueError:\n"
        "        print(json.dumps(True)); break\n"
        "else:\n"
        "    print(json.dumps(False))"
    )
    assert gone is True
    codes = [cluster.chat().status_code for _ in range(8)]
    assert codes == [200] * 8
