"""A real Redis Cluster for tests: N ``redis-server --cluster-enabled yes`` nodes on loopback TCP.

`RedisCluster` starts ``masters * (1 + replicas)`` `RedisServer` nodes, each
on 127.0.0.1 with a port the OS picked, in its own temporary directory
(``appendfsync everysec`` by default, ``cluster-node-timeout`` short, so a
failover takes about a second), then runs ``redis-cli --cluster create ...
--cluster-replicas R --cluster-yes`` and waits, polling ``CLUSTER INFO``
against a deadline, until every node reports ``cluster_state:ok`` and every
replica its master link up, and every node's ``CLUSTER SLOTS`` names every
live node (gossip settled, so a client sees every replica).  `kill`
SIGKILLs one node; `wait_promoted` waits (the same polling, with a
deadline) until a replica of a killed master serves its slots as a
master and every live node agrees the cluster is ok.  `url` gives the
``redis+cluster://`` URL of the live nodes (with credentials when asked).

Nothing here sleeps blindly: every wait is a condition polled until it
holds or the deadline passes, which fails the test with the nodes' state.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from types import TracebackType

from prereq import requires
from redis_server import REDIS_SERVER, RedisServer, redis

REDIS_CLI = shutil.which("redis-cli")

requires_redis_cluster = requires(
    REDIS_SERVER is not None and REDIS_CLI is not None,
    "redis-server or redis-cli is not installed (apt-get install redis-server redis-tools)",
)

#: How often a wait polls its condition (the conditions are cheap CLUSTER INFO reads).
_POLL = 0.05


def _cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


def _wait(
    condition: Callable[[], bool], timeout: float, what: str, dump: Callable[[], str]
) -> None:
    """Poll ``condition`` until it holds; fail with ``dump()`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    stop = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}:\n{dump()}")
        stop.wait(_POLL)


class ClusterNode(RedisServer):
    """A cluster node: its admin client speaks TCP.

    In cluster mode redis-server 7.0 logs "Ready to accept connections"
    before it has set up its listeners, so `start` then polls PING.
    """

    def start(self, timeout: float = 20.0) -> None:
        """Start the node; wait for its ready line, then until PING answers."""
        try:
            super().start(timeout)
        except redis.ConnectionError:

            def answers() -> bool:
                try:
                    with self.client() as c:
                        return bool(c.ping())
                except redis.ConnectionError:
                    return False

            _wait(answers, timeout, f"node {self.port} to answer PING", lambda: "\n".join(self.log))

    def client(self) -> redis.Redis:
        """An admin client (the default user) over TCP."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)


class RedisCluster:
    """A cluster of redis-server nodes (see the module docstring)."""

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        appendfsync: str = "everysec",
    ) -> None:
        """Prepare the nodes (they start with `start`)."""
        self.masters = masters
        self.replicas = replicas
        self.nodes: list[ClusterNode] = []
        for _ in range(masters * (1 + replicas)):
            node = ClusterNode(tcp=True, appendfsync=appendfsync)
            node.port = _cluster_port()  # the bus port (+10000) must exist and be free
            node.extra_args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node.dir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # A replica whose master died long ago may still take over.
                "--cluster-replica-validity-factor", "0",
            ]  # fmt: skip
            self.nodes.append(node)
        self.dead: set[int] = set()

    # --- life cycle -----------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start every node, create the cluster, wait until every node says it is ok."""
        for node in self.nodes:
            node.start()
        assert REDIS_CLI is not None
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        replicas = ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        out = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, *replicas],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        self.wait_ok(timeout)

    def live(self) -> list[ClusterNode]:
        """The nodes not killed."""
        return [n for i, n in enumerate(self.nodes) if i not in self.dead]

    def info(self, node: ClusterNode) -> dict[str, str]:
        """``CLUSTER INFO`` of a node (empty when it does not answer)."""
        try:
            with node.client() as c:
                info = c.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
        except redis.RedisError:
            return {}
        return {str(k): str(v) for k, v in info.items()}

    def role(self, node: ClusterNode) -> dict[str, str]:
        """``INFO replication`` of a node (empty when it does not answer)."""
        try:
            with node.client() as c:
                return {k: str(v) for k, v in c.info("replication").items()}
        except redis.RedisError:
            return {}

    def _dump(self) -> str:
        lines = []
        for i, n in enumerate(self.nodes):
            state = "killed" if i in self.dead else self.info(n).get("cluster_state", "?")
            role = self.role(n) if i not in self.dead else {}
            link = role.get("master_link_status", "")
            lines.append(f"node {n.port}: {state} {role.get('role', '')} link={link}")
        return "\n".join(lines)

    def _listed(self, node: ClusterNode) -> int:
        """How many nodes ``CLUSTER SLOTS`` of ``node`` names (masters and replicas)."""
        try:
            with node.client() as c:
                slots = c.execute_command("CLUSTER SLOTS")
        except redis.RedisError:
            return 0
        # [[first slot, last slot, [host, port, id, ...] of the master, of each replica...]]
        return len({int(node[1]) for _lo, _hi, *nodes in slots for node in nodes})

    def _healthy(self) -> bool:
        live = self.live()
        for n in live:
            if self.info(n).get("cluster_state") != "ok":
                return False
            # Gossip settled: this node knows every live master and replica.
            if self._listed(n) != len(live):
                return False
            role = self.role(n)
            if role.get("role") == "slave" and role.get("master_link_status") != "up":
                return False
        return True

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and every replica its link up."""
        _wait(self._healthy, timeout, "cluster_state:ok on every node", self._dump)

    def master_of(self, key: str) -> ClusterNode:
        """The live node that serves ``key``'s slot as a master now."""
        with self.live()[0].client() as c:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            for lo, hi, master, *_ in c.execute_command("CLUSTER SLOTS"):
                if lo <= slot <= hi:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no master serves the slot of {key!r}")

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        """The live replicas of ``master``."""
        out = []
        for n in self.live():
            role = self.role(n)
            if role.get("role") == "slave" and int(role.get("master_port", 0)) == master.port:
                out.append(n)
        return out

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL a node (a crash)."""
        node.kill()
        self.dead.add(self.nodes.index(node))

    def wait_promoted(self, old: ClusterNode, key: str, timeout: float = 30.0) -> ClusterNode:
        """Wait until another node serves ``key``'s slot as a master and the cluster is ok."""

        def promoted() -> bool:
            try:
                master = self.master_of(key)
            except (redis.RedisError, AssertionError):
                return False
            return master is not old and self.role(master).get("role") == "master"

        _wait(promoted, timeout, f"a replica of {old.port} to take over", self._dump)
        self.wait_ok(timeout)
        return self.master_of(key)

    # --- clients ----------------------------------------------------------------

    def url(self, user: str | None = None, password: str | None = None) -> str:
        """The ``redis+cluster://`` URL of the live nodes (with credentials if given)."""
        auth = f"{user}:{password}@" if user is not None and password is not None else ""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.live())
        return f"redis+cluster://{auth}{hosts}"

    def admin(self) -> redis.RedisCluster:
        """An admin client of the whole cluster (the default user)."""
        n = self.live()[0]
        return redis.RedisCluster(host="127.0.0.1", port=n.port, socket_timeout=10)

    def for_each_node(self, *command: object) -> None:
        """Run a command on every live node (e.g. ``ACL SETUSER``: ACLs are per node)."""
        for n in self.live():
            with n.client() as c:
                c.execute_command(*command)

    def stop(self) -> None:
        """Stop every node and remove their directories."""
        for n in self.nodes:
            n.stop()
            shutil.rmtree(n.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        """Start; stopped and removed on exit."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop every node."""
        self.stop()
