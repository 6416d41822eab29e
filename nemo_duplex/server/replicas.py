"""Several engine replicas behind one endpoint, on Ray Serve (`serve.replicas=N`; docs/deploy.md).

Each replica is the whole one-process server (server/app.py's Starlette app, its engine and its call pools)
running inside a Ray Serve replica with one GPU (`num_gpus=1`; on the CPU, none). Serve's proxy takes every
route on serve.host:serve.port and hands each request, a WebSocket for the whole life of its call, to one
replica; the call's state never leaves that replica's device.

- Routing (server/routing.py, `MostFreePlaces`): every live replica is a candidate and the one with the
  fewest requests in flight takes the call. Every replica has the same engine.max_calls, so that is the one
  with the most free places. Serve's own limit (`max_ongoing_requests`) sits above serve.max_connections, so Serve never
  queues a call: a full replica refuses it with `busy` itself, and it is only chosen when all are full.
- /health and /metrics speak for the whole deployment (`Registry`): each replica reports its readiness and
  its Prometheus text every second; /health is 200 when every replica is ready, /metrics is every replica's
  text labelled `replica="..."` plus the deployment's own gauges.
- A replica that dies takes only its calls: Serve's proxy then has nothing more to send, so `ReplicaGone`
  (installed in the proxy through RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH) ends each of them with the error
  `replica_failed` (then close code 1011, or the end of an upload's stream). Serve starts a replacement;
  the router stops choosing the dead one as soon as it is gone.
- A call whose connection is lost is resumed on its own replica, and a Realtime call opened with a client secret
  goes to the replica that minted it (`ReplicaRoute`, in the proxy too): the token or secret names the replica,
  and the router follows that.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from urllib.parse import parse_qsl

from starlette.datastructures import Headers

from nemo_duplex import REPO
from nemo_duplex.server.access import Access
from nemo_duplex.server.client_secrets import PREFIX as SECRET_PREFIX
from nemo_duplex.server.ws import TRANSPORT_LOST

log = logging.getLogger("nemo_duplex.replicas")
APP_NAME = "nemo_duplex"
REGISTRY = "nemo_duplex_registry"
PROXY_CALLBACK = "nemo_duplex.server.replicas.proxy_middlewares"
STALE_AFTER_S = 3.0          # a replica not heard from for this long is not ready (dead or stuck; it reports each second)
FORGET_AFTER_S = 60.0        # ... and after this long it is no longer listed (Serve replaces a dead replica)
CALL_ROUTES = ("/v1/realtime", "/generate/ws")
UPLOAD_ROUTE = "/generate"


# ---- the proxy: a call whose replica died ends with an error, not a bare TCP reset -------------------------
class ReplicaGone:
    """ASGI middleware in Serve's proxy. When the replica behind a call dies, the proxy has nothing more to
    send: an open WebSocket would drop without a close frame (1006), an upload's NDJSON stream would stop
    mid-way. This ends them as the protocol ends a failed call instead: the error `replica_failed`, then a
    close with 1011 (WebSocket) or the end of the stream (upload)."""

    MESSAGE = "the replica serving this call stopped; the call is lost (new calls go to the other replicas)"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path")
        if not ((scope["type"] == "websocket" and path in CALL_ROUTES)
                or (scope["type"] == "http" and path == UPLOAD_ROUTE)):
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False, "client_gone": False, "dropping": False}

        async def watched_receive():
            message = await receive()
            if message["type"] in ("websocket.disconnect", "http.disconnect"):
                state["client_gone"] = True
            return message

        async def watched_send(message) -> None:
            kind = message["type"]
            if state["dropping"] or (kind in ("websocket.accept", "http.response.start") and state["started"]):
                state["dropping"] = True   # an error reply of the proxy's after the call's own reply began
                return
            if kind in ("websocket.accept", "http.response.start"):
                state["started"] = True
            elif kind == "websocket.close" or (kind == "http.response.body" and not message.get("more_body")):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            if state["started"] and not state["ended"] and not state["client_gone"]:
                await self._fail(scope, send)

    @classmethod
    async def _fail(cls, scope, send) -> None:
        if scope["path"] == "/v1/realtime":
            from nemo_duplex.server.realtime_protocol import error_event
            body = error_event(f"event_{uuid.uuid4().hex[:8]}", "replica_failed", cls.MESSAGE)
        else:
            body = {"type": "error", "code": "replica_failed", "message": cls.MESSAGE}
        try:
            if scope["type"] == "websocket":
                await send({"type": "websocket.send", "text": json.dumps(body)})
                await send({"type": "websocket.close", "code": 1011, "reason": "replica_failed"})
            else:
                await send({"type": "http.response.body", "body": (json.dumps(body) + "\n").encode(),
                            "more_body": False})
        except Exception:   # the client is gone too
            pass


class ReplicaHeader:
    """`X-Replica: <id>` on every response and WebSocket handshake of a replica: which replica holds a call
    (logs, tests, a client's bug report)."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (b"x-replica", replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        async def labelled(message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, labelled)


class ReplicaRoute:
    """ASGI middleware in Serve's proxy: a call goes to the replica that holds what it needs. A resumed call
    (`?resume=<token>`, docs/protocol.md) goes to the replica that holds it, a Realtime call opened with a client
    secret to the replica that minted it. A token or secret begins with that replica's id
    (resume.Parking.new_token, ClientSecrets.mint); this gives it to Serve as the request's session id (the header
    Serve reads, x-session-id), which the router (server/routing.py) follows.
    A session id from the client itself is dropped: it would pin calls to a replica of its choosing. And a
    WebSocket whose transport was lost without a close frame (marked by the proxy's uvicorn protocol,
    server/transport.py) reaches the replica as a disconnect with 1006, the code a lost connection has there,
    not uvicorn's 1005, which a client's close frame without a code has too."""

    HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower().replace("_", "-")

    def __init__(self, app):
        self.app = app

    @staticmethod
    def route(scope) -> str:
        """The replica a call must go to: the one its resume token names, else (a Realtime call opened with a
        client secret, server/client_secrets.py) the one that minted the secret; "" for any."""
        token = next((v for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k == "resume"), "")
        if not token and scope.get("path") == "/v1/realtime":
            key = Access.key(Headers(scope=scope)) or ""
            token = key[len(SECRET_PREFIX):] if key.startswith(SECRET_PREFIX) else ""
        route, dot, _ = token.partition(".")
        return route if dot else ""

    @classmethod
    def _is_session_header(cls, name: bytes) -> bool:
        return name.decode("latin-1").lower().replace("_", "-") == cls.HEADER

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope.get("headers", []) if not self._is_session_header(k)]
        if scope["type"] == "websocket" and scope.get("path") in CALL_ROUTES:
            route = self.route(scope)
            if route:
                headers.append((self.HEADER.encode(), route.encode("latin-1")))
        marked = scope   # (the protocol marks the scope it made, not this middleware's copy)
        scope = {**scope, "headers": headers}
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)

        async def lost_is_1006():
            message = await receive()
            if message["type"] == "websocket.disconnect" and marked.get(TRANSPORT_LOST):
                message = {**message, "code": 1006}
            return message
        await self.app(scope, lost_is_1006, send)


def proxy_middlewares():
    """Serve's proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): the middlewares it installs. It runs
    before the proxy starts its uvicorn server, which takes its "auto" WebSocket protocol by name when it starts:
    set here to server/transport.py's, which marks a lost transport (ReplicaRoute passes that on)."""
    from starlette.middleware import Middleware
    from uvicorn.protocols.websockets import auto

    from nemo_duplex.server.transport import websocket_protocol

    auto.AutoWebSocketsProtocol = websocket_protocol(None)
    return [Middleware(ReplicaRoute), Middleware(ReplicaGone)]


# ---- the deployment's health and metrics ------------------------------------------------------------------
def registry_class():
    import ray

    @ray.remote(num_cpus=0)
    class Registry:
        """What each replica last reported: (monotonic time, report)."""

        def __init__(self, expected: int):
            self.expected, self.reports = expected, {}

        def report(self, replica: str, report: dict) -> None:
            self.reports[replica] = (time.monotonic(), report)

        def snapshot(self) -> dict:
            now = time.monotonic()
            self.reports = {r: (t, rep) for r, (t, rep) in self.reports.items() if now - t < FORGET_AFTER_S}
            return {"expected": self.expected,
                    "replicas": {r: {**rep, "fresh": now - t < STALE_AFTER_S}
                                 for r, (t, rep) in self.reports.items()}}

    return Registry


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def label_metrics(text: str, replica: str, seen: set[str]) -> list[str]:
    """One replica's Prometheus text with `replica="..."` on every sample; a metric's HELP/TYPE lines only
    the first time (`seen`)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            key = " ".join(parts[:3])
            if key not in seen:
                seen.add(key)
                out.append(line)
            continue
        m = SAMPLE.match(line)
        if m is None:
            continue
        name, labels, rest = m.groups()
        inner = labels[1:-1] if labels else ""
        out.append(f'{name}{{replica="{replica}"{"," + inner if inner else ""}}}{rest}')
    return out


def deployment_health(snapshot: dict) -> tuple[dict, int]:
    """The deployment's /health: 200 when `expected` replicas are fresh and ready."""
    reps = snapshot["replicas"]
    ready = sorted(r for r, rep in reps.items() if rep["fresh"] and rep["ready"])
    body = {"status": "ready" if len(ready) >= snapshot["expected"] else "starting",
            "replicas_expected": snapshot["expected"], "replicas_ready": len(ready),
            "active_calls": sum(rep["active_calls"] for rep in reps.values() if rep["fresh"]),
            "max_calls": sum(rep["max_calls"] for rep in reps.values() if rep["fresh"]),
            "replicas": {r: {k: rep[k] for k in ("ready", "fresh", "active_calls", "sessions", "max_calls", "pid")}
                         for r, rep in sorted(reps.items())}}
    return body, 200 if body["status"] == "ready" else 503


def deployment_metrics(snapshot: dict) -> str:
    reps = snapshot["replicas"]
    seen: set[str] = set()
    lines = ["# HELP duplex_replicas_expected replicas the deployment runs (serve.replicas)",
             "# TYPE duplex_replicas_expected gauge", f"duplex_replicas_expected {snapshot['expected']}",
             "# HELP duplex_replicas_ready replicas reporting ready within the last few seconds",
             "# TYPE duplex_replicas_ready gauge",
             f"duplex_replicas_ready {sum(1 for rep in reps.values() if rep['fresh'] and rep['ready'])}"]
    for r, rep in sorted(reps.items()):
        if rep["fresh"]:
            lines += label_metrics(rep["metrics"], r, seen)
    return "\n".join(lines) + "\n"


class ReplicaCluster:
    """What a replica's Server asks about the deployment (Server.cluster): the registry's view."""

    def __init__(self, replica: str):
        import ray

        self.replica = replica
        self.registry = ray.get_actor(REGISTRY, namespace=APP_NAME)

    async def report(self, server) -> None:
        """This replica's readiness and metrics (just sampled), to the registry: Server._sample_metrics calls it
        every second."""
        report = {"ready": server.healthy(), "active_calls": server.engine.active_calls,
                  "sessions": len(server.sessions), "max_calls": server.max_calls, "pid": os.getpid(),
                  "metrics": server.metrics.render().decode()}
        try:
            await self.registry.report.remote(self.replica, report)
        except Exception:   # the registry is gone: the deployment is stopping
            log.warning("replica %s: the registry did not take the report", self.replica)

    async def health(self) -> tuple[dict, int]:
        return deployment_health(await self.registry.snapshot.remote())

    async def metrics(self) -> str:
        return deployment_metrics(await self.registry.snapshot.remote())


# ---- the replica ------------------------------------------------------------------------------------------
def replica_class():
    from ray import serve

    @serve.ingress()
    class Replica:
        """One engine and its server, built from the driver's composed config (a plain dict) and the
        command line's overrides (which settings the user gave, runtime.resolve_model)."""

        def __init__(self, cfg: dict, overrides: list[str]):
            from omegaconf import OmegaConf

            from nemo_duplex import settings
            from nemo_duplex.server.build import build_server

            settings.register()
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
            composed = OmegaConf.merge(OmegaConf.structured(settings.ServeApp), cfg)   # typed, as Hydra made it
            sys.setswitchinterval(float(composed.serve.gil_switch_interval_ms) / 1e3)
            self.server = build_server(composed, overrides)
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.server.cluster = ReplicaCluster(self.replica)
            # resume tokens and client secrets name it: their calls are sent here (ReplicaRoute)
            self.server.call_connections.route = self.server.client_secrets.route = self.replica

        def __serve_build_asgi_app__(self):
            return ReplicaHeader(self.server.app(), self.replica)

        def check_health(self) -> None:
            """Serve's health check: a replica whose engine thread died (its calls have ended with
            engine_error already) or whose step or admission never finishes (Server.stalls) is restarted."""
            if self.server.ready and not self.server.healthy():
                stalls = self.server.stalls()
                raise RuntimeError(", ".join(f"{name} for {seconds:.0f} s" for name, seconds in stalls.items())
                                   if stalls else "the engine thread is down")

    return Replica


# ---- the driver -------------------------------------------------------------------------------------------
def check_replicas_fit(cfg, resolved, n: int) -> None:
    """On the CPU the N replicas share this machine's memory: all of them must fit in it (on CUDA each
    replica has its own GPU and checks it when it loads)."""
    if str(cfg.device).startswith("cuda") or not cfg.memory.check:
        return
    from nemo_duplex.serving.memory import GiB, MemoryPlanError, check_fits

    engine = cfg.engine
    plan = check_fits(resolved.cfg, "cpu", device_gib=cfg.memory.device_gib, reserve_gib=cfg.memory.reserve_gib,
                      calls=(engine.max_calls, engine.max_call_s), max_prompt_tokens=int(engine.max_prompt_tokens),
                      prefix_cache_mib=int(engine.prefix_cache_mib), kv_pool_gib=engine.kv_pool_gib)
    if plan.total * n > plan.device_memory:
        raise MemoryPlanError(f"serve.replicas={n} on the CPU: {n} x {plan.total / GiB:.2f} GiB needed, "
                              f"{plan.device_memory / GiB:.2f} GiB available")


def run(cfg, overrides: list[str]) -> None:
    """Start (or join, serve.ray_address) a Ray cluster, deploy serve.replicas replicas behind Serve's proxy
    on serve.host:serve.port, and serve until SIGINT / SIGTERM."""
    from omegaconf import OmegaConf

    from nemo_duplex import runtime

    n, scfg = int(cfg.serve.replicas), cfg.serve
    if str(cfg.device) not in ("cpu", "cuda"):
        raise runtime.SettingsError(f"device={cfg.device} with serve.replicas={n}: each replica gets its own GPU "
                                    "(Ray picks it); give device=cuda")
    gpus = 1 if cfg.device == "cuda" else 0
    # refusals come here, in seconds, before Ray starts: no checkpoint, bad settings, not enough memory.
    # (An embedded checkpoint is generated here once, not by every replica.)
    resolved = runtime.resolve_model(cfg, overrides)
    if gpus == 0:   # engine.max_calls=null on the CPU: settled here; on GPUs each replica settles it on its own
        runtime.settle_max_calls(cfg, resolved.cfg, "cpu")
    check_replicas_fit(cfg, resolved, n)

    try:
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions, RequestRouterConfig
    except ImportError as e:
        raise runtime.SettingsError(f"serve.replicas={n} runs on Ray Serve, which is not installed here ({e}): "
                                    "pip install -e '.[cluster]'") from None

    # the proxy and the replicas import this package; a local cluster's processes inherit this environment
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK}
    os.environ.update(env)
    ray.init(address=scfg.ray_address or "local", namespace=APP_NAME, include_dashboard=False,
             runtime_env={"env_vars": env})
    serve.start(http_options=HTTPOptions(host=scfg.host, port=int(scfg.port)))
    registry = registry_class().options(name=REGISTRY, namespace=APP_NAME).remote(n)
    # (engine.max_calls null on GPUs: no replica takes more places than the largest capture bucket)
    places = cfg.engine.max_calls if cfg.engine.max_calls is not None else max(cfg.engine.capture_buckets, default=1)
    max_connections = scfg.max_connections if scfg.max_connections is not None else places + 16
    deployment = serve.deployment(replica_class()).options(
        name="Replica", num_replicas=n,
        ray_actor_options={"num_gpus": gpus, "num_cpus": 1 if gpus else 0},
        # above the replica's own connection limit, so Serve never queues: the replica refuses with busy
        max_ongoing_requests=max_connections + 64,
        request_router_config=RequestRouterConfig(request_router_class="nemo_duplex.server.routing.MostFreePlaces"),
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=float(scfg.shutdown_grace_s) + 5.0)
    serve.run(deployment.bind(OmegaConf.to_container(cfg, resolve=True), list(overrides)), name=APP_NAME,
              route_prefix="/", blocking=False)
    each = cfg.engine.max_calls if cfg.engine.max_calls is not None else "what its GPU holds"
    print(f"serving {n} replicas on http://{scfg.host}:{scfg.port} (Ray Serve; engine.max_calls: {each} "
          "each); ready after warm-up, see /health", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("stopping: the replicas drain their calls (serve.shutdown_grace_s)", flush=True)
    serve.shutdown()
    ray.kill(registry)
    ray.shutdown()
