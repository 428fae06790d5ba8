"""A real multi-node Ray cluster on this machine, for the ray provider's tests.

Nodes are real raylets (``ray.cluster_utils.Cluster``) listening on 127.0.0.1 only. The head
has no CPU, so it hosts no sandbox; nodes ``a`` and ``b`` have one CPU each and a custom
resource named after them. One cluster serves a whole test module: Ray starts slowly on two
cores.
"""

from __future__ import annotations

import os

# Ray's switch for single-machine clusters: with it off, Ray takes 127.0.0.1 for this node's
# address instead of the machine's outward one, so no Ray process listens beyond loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest

ray = pytest.importorskip("ray", reason="the ray provider needs Ray: pip install 'rollbox[ray]'")
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

ray_constants.ENABLE_RAY_CLUSTER = False  # the same switch, if Ray was imported before


class RayCluster:
    """The cluster, with its worker nodes by name."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                # A killed node is declared dead in ~3 s instead of ~15 s.
                "_system_config": {
                    "health_check_period_ms": 1000,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self.nodes: dict[str, object] = {}
        for name in ("a", "b"):
            self.add_node(name)
        ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)
        self.cluster.wait_for_nodes()

    def add_node(self, name: str, cpus: int = 1) -> str:
        """Start a worker node with ``cpus`` CPUs and the custom resource ``name``; its id."""
        node = self.cluster.add_node(
            num_cpus=cpus, resources={name: 1}, node_ip_address="127.0.0.1"
        )
        self.nodes[name] = node
        if ray.is_initialized():
            self.cluster.wait_for_nodes()
        return node.node_id

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id  # type: ignore[attr-defined]

    def raylet_pid(self, name: str) -> int:
        """The pid of node ``name``'s raylet: host actors run in its worker processes."""
        processes = self.nodes[name].all_processes[ray_constants.PROCESS_TYPE_RAYLET]  # type: ignore[attr-defined]
        return processes[0].process.pid

    def kill_node(self, name: str) -> None:
        """Kill a node as a crash would: its raylet is SIGKILLed, its workers follow."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


_cluster: RayCluster | None = None


def ray_cluster() -> RayCluster:
    """The cluster, started on first use."""
    global _cluster
    if _cluster is None:
        _cluster = RayCluster()
    return _cluster


def stop_ray_cluster() -> None:
    """Stop the cluster if one was started."""
    global _cluster
    if _cluster is not None:
        _cluster.shutdown()
        _cluster = None
