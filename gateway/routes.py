"""The routing table as the request path uses it, and how it stays current.

`RouteTable` (protocol.gateway) is the wire shape; `RoutingTable` is the same content compiled
once per change for the hot path: model name -> `Route`, key id -> `ClientGrant`, each instance's
request-line bytes ready. A table is immutable: `Routes.install` swaps in a new one with one
assignment, so a request holds one consistent table from start to end.

`Routes` also remembers the client tokens earlier tables listed and the current one does not
(`RoutingTable.former_clients`, at most `MAX_FORMER_CLIENTS`), so a revoked token's refusal can
be counted as such.

`Routes.next_table()` lets a request wait for the next table without polling (one held for a
deployment scaled to zero, `cold_start`).

`RouteWatcher` keeps `Routes` current from the control plane: a poll every `poll_s` with the
last ETag (a 304 costs the control plane nothing), and while the control plane is down the last
table keeps serving; one warning per outage, one line when it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from protocol.gateway import DeploymentRoute, Pool, RouteClient, RoutePool, RouteTable

log = logging.getLogger("dctl.gateway.routes")

MAX_FORMER_CLIENTS = 4096


@dataclass(frozen=True, eq=False)
class Instance:
    """One engine instance of one version: where to connect and what to send it."""

    id: int
    deployment: str
    version: str
    scheme: str
    address: str
    port: int
    host_header: bytes  # `address:port`, bracketed for IPv6
    authorization: bytes  # `Bearer <the instance's API key>`: never logged

    @property
    def target(self) -> tuple[str, str, int]:
        """What the connection pool keys idle connections by."""
        return (self.scheme, self.address, self.port)

    def __repr__(self) -> str:  # the default would print the API key
        return f"Instance({self.id}, {self.version}, {self.scheme}://{self.address}:{self.port})"


@dataclass(frozen=True)
class VersionPool:
    """The ready instances of one version, as the stable or the canary pool of a deployment."""

    deployment: str
    name: Pool
    version_id: int  # what its traffic windows are reported by
    version: str  # MODEL:VERSION, for people: metric labels, logs
    version_header: bytes  # x-dctl-version
    instances: tuple[Instance, ...]


@dataclass(frozen=True)
class Route:
    """Where one deployment's requests go."""

    deployment: str
    model_names: tuple[str, ...]
    stable: VersionPool
    canary: VersionPool | None
    canary_weight: int
    cold_start_timeout_s: float | None = None  # set: scales to zero; hold requests this long

    def pool(self, name: Pool) -> VersionPool | None:
        """The pool called NAME (None: no canary)."""
        return self.stable if name == "stable" else self.canary

    @property
    def has_instances(self) -> bool:
        """Whether either pool lists a ready instance."""
        return any(pool.instances for pool in _pools(self))


@dataclass(frozen=True)
class ClientGrant:
    """A client token the gateway accepts: its hash, scope, expiry (epoch seconds) and grants."""

    key_id: str
    name: str
    secret_sha256: str
    deployments: frozenset[str] | None  # None: every deployment
    expires_at: float | None
    allow_pool_pin: bool = False  # may send `x-dctl-pool`
    max_concurrency: int | None = None  # None: the gateway's max_concurrency_per_token

    def may_use(self, deployment: str) -> bool:
        """Whether this token's scope includes DEPLOYMENT."""
        return self.deployments is None or deployment in self.deployments


@dataclass(frozen=True)
class RoutingTable:
    """A compiled `RouteTable`: lookups by model name and by key id."""

    etag: str
    routes: tuple[Route, ...]
    by_model: dict[str, Route]
    clients: dict[str, ClientGrant]
    # Key id -> grant of tokens earlier tables listed and this one does not (revoked, deleted).
    former_clients: Mapping[str, ClientGrant] = field(default_factory=dict)

    @classmethod
    def compile(cls, table: RouteTable, previous: RoutingTable | None = None) -> RoutingTable:
        """Compile TABLE (PREVIOUS: the table it replaces, whose clients it remembers). A model
        name two deployments claim goes to the first one listed."""
        routes = tuple(_route(d) for d in table.deployments)
        by_model: dict[str, Route] = {}
        for route in routes:
            for name in route.model_names:
                if name in by_model:
                    log.warning(
                        "model name %r is served by deployments %s and %s; %s gets it",
                        name, by_model[name].deployment, route.deployment,
                        by_model[name].deployment,
                    )  # fmt: skip
                    continue
                by_model[name] = route
        clients = {c.key_id: _grant(c) for c in table.clients}
        return cls(table.etag, routes, by_model, clients, _former(previous, clients))

    def models_for(self, grant: ClientGrant) -> list[str]:
        """The model names GRANT may use, sorted."""
        return sorted(
            name for name, route in self.by_model.items() if grant.may_use(route.deployment)
        )

    def route(self, deployment: str) -> Route | None:
        """DEPLOYMENT's route (None: not in this table)."""
        return next((r for r in self.routes if r.deployment == deployment), None)

    def instance_ids(self) -> set[int]:
        """Every instance id in the table."""
        return {i.id for route in self.routes for pool in _pools(route) for i in pool.instances}


def _former(
    previous: RoutingTable | None, clients: dict[str, ClientGrant]
) -> dict[str, ClientGrant]:
    """The clients PREVIOUS listed or remembered that CLIENTS does not, the latest gone last."""
    if previous is None:
        return {}
    former = {k: g for k, g in previous.former_clients.items() if k not in clients}
    former.update((k, g) for k, g in previous.clients.items() if k not in clients)
    excess = len(former) - MAX_FORMER_CLIENTS
    return dict(list(former.items())[excess:]) if excess > 0 else former


def _pools(route: Route) -> Iterable[VersionPool]:
    return (route.stable,) if route.canary is None else (route.stable, route.canary)


def _route(d: DeploymentRoute) -> Route:
    canary = _pool(d.deployment, "canary", d.canary) if d.canary is not None else None
    return Route(
        deployment=d.deployment,
        model_names=tuple(d.model_names),
        stable=_pool(d.deployment, "stable", d.stable),
        canary=canary,
        canary_weight=d.canary_weight if canary is not None else 0,
        cold_start_timeout_s=d.cold_start_timeout_s,
    )


def _pool(deployment: str, name: Pool, pool: RoutePool) -> VersionPool:
    instances = tuple(
        Instance(
            id=i.id,
            deployment=deployment,
            version=pool.version,
            scheme=i.scheme,
            address=i.address,
            port=i.port,
            host_header=_host_header(i.address, i.port),
            authorization=f"Bearer {i.api_key}".encode("latin-1"),
        )
        for i in pool.instances
    )
    return VersionPool(
        deployment, name, pool.version_id, pool.version, pool.version.encode("latin-1"), instances
    )


def _host_header(address: str, port: int) -> bytes:
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}".encode("ascii", "replace")


def _grant(client: RouteClient) -> ClientGrant:
    expires = client.expires_at
    return ClientGrant(
        key_id=client.key_id,
        name=client.name,
        secret_sha256=client.secret_sha256.lower(),
        deployments=None if client.deployments is None else frozenset(client.deployments),
        expires_at=None if expires is None else expires.timestamp(),
        allow_pool_pin=client.allow_pool_pin,
        max_concurrency=client.max_concurrency,
    )


class Routes:
    """The routing table in force (None until the first one arrives)."""

    def __init__(self, on_install: Callable[[RoutingTable], None] | None = None) -> None:
        self.current: RoutingTable | None = None
        self._on_install = on_install
        self._next: set[asyncio.Future[RoutingTable]] = set()

    def install(self, table: RouteTable) -> RoutingTable:
        """Compile TABLE and make it the one in force."""
        compiled = RoutingTable.compile(table, self.current)
        self.current = compiled
        if self._on_install is not None:
            self._on_install(compiled)
        waiting, self._next = self._next, set()
        for future in waiting:
            if not future.done():
                future.set_result(compiled)
        return compiled

    def next_table(self) -> asyncio.Future[RoutingTable]:
        """A future of the next table installed; cancel it to stop waiting."""
        future: asyncio.Future[RoutingTable] = asyncio.get_running_loop().create_future()
        self._next.add(future)
        future.add_done_callback(self._next.discard)
        return future


class RouteSource(Protocol):
    """Where routing tables come from: `client.http.AsyncControlPlaneClient` implements it."""

    async def routes(self, etag: str | None = None) -> RouteTable | None:
        """The table, or None when it still has ETAG (HTTP 304)."""
        ...


class RouteWatcher:
    """Polls SOURCE every POLL_S and installs each new table into ROUTES.

    States: `waiting` (no table yet) -> `current` <-> `stale` (control plane unreachable: the last
    table serves on; logged once when it starts and once when it ends).
    """

    def __init__(self, source: RouteSource, routes: Routes, poll_s: float) -> None:
        self.source = source
        self.routes = routes
        self.poll_s = poll_s
        self.failing_since_poll: int | None = None  # poll number the current outage began at
        self.polls = 0

    async def poll_once(self) -> bool:
        """One poll; True when a new table was installed."""
        self.polls += 1
        current = self.routes.current
        try:
            table = await self.source.routes(current.etag if current is not None else None)
        except Exception as exc:  # ClientError, or anything else: the watcher must live on
            if self.failing_since_poll is None:
                self.failing_since_poll = self.polls
                serving = f"serving the last table ({current.etag})" if current else "no table yet"
                log.warning("cannot read routes from the control plane: %s; %s", exc, serving)
            return False
        if self.failing_since_poll is not None:
            log.info(
                "routes readable again after %d failed polls", self.polls - self.failing_since_poll
            )
            self.failing_since_poll = None
        if table is None:
            return False
        compiled = self.routes.install(table)
        log.info(
            "routing table installed",
            extra={"etag": compiled.etag, "deployments": len(compiled.routes),
                   "clients": len(compiled.clients)},
        )  # fmt: skip
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)
