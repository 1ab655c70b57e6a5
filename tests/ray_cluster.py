"""A local Ray cluster of two simulated nodes for a test module, and what is checked through Ray.

Dashboard off; node health checked every 200 ms, three misses a death (production: 3 s and 5
misses, see the README), so a lost node is found in about a second. The leak checks of a Ray
module look at Ray (no actor of ours alive, no placement group left) and at this process's
children less the cluster's own (its raylets, its GCS, its idle workers)."""

from __future__ import annotations

import contextlib
import os

import psutil

from tests.conftest import live_children, wait_until

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError:  # the ray extra brings it
    ray = None
if ray is None and os.environ.get("CI") == "true":
    raise RuntimeError("the Ray tests need Ray under CI: pip install -e '.[test,ray]'")
MISSING = "Ray is not installed (the ray extra)" if ray is None else None

HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 200,
    "health_check_failure_threshold": 3,
}


@contextlib.contextmanager
def two_nodes(cpus: int = 1):
    """Head and one more node, `cpus` CPUs each; this process connected to it while in use."""
    from vllm_omni_like.executor import ray_runtime

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus, "include_dashboard": False, "_system_config": HEALTH},
    )
    try:
        c.add_node(num_cpus=cpus)
        c.wait_for_nodes()
        ray_runtime.configure(c.address)
        ray_runtime.ray_module()
        yield c
    finally:
        ray_runtime.shutdown(joined_too=True)
        ray_runtime.configure(None)
        c.shutdown()


def ours_alive() -> list:
    """Our worker actors still alive (read through Ray, connected again if need be)."""
    from vllm_omni_like.executor import ray_runtime

    ray_runtime.ray_module()
    return [
        a
        for a in ray._private.state.actors().values()
        if a["State"] != "DEAD" and "WorkerActor" in a["ActorClassName"]
    ]


def groups_left() -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def actor_processes() -> list[psutil.Process]:
    """Processes running one of our worker actors (Ray names them after the class)."""
    found = []
    for p in live_children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if "WorkerActor" in " ".join(p.cmdline()):
                found.append(p)
    return found


def nothing_left(bound: float = 10) -> None:
    assert wait_until(lambda: not ours_alive() and not groups_left(), bound), (
        ours_alive(),
        groups_left(),
    )
    assert wait_until(lambda: not actor_processes(), bound), actor_processes()
