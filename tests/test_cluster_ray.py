"""`flide_sdk.cluster` on a local Ray cluster (2 CPUs, 2 replicas of the tiny engine). Needs the `ray` extra,
skipped without it (CI runs tests/test_cluster.py, the same behaviour behind a fake handle):

    pip install -e ".[ray,test]" && python -m pytest tests/test_cluster_ray.py
"""

from __future__ import annotations

import asyncio

import pytest

import flide_sdk as fl
from flide_sdk.cluster import ClusterClient, app_builder

from .test_cluster import step_all

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ROUTING_SETTLES_S = 1.5  # Serve's routers learn which replica serves a session family within this


@pytest.fixture(scope="module")
def client(tiny_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        app = app_builder({"path": str(tiny_path), "num_replicas": "2", "num_cpus": "0.5", "device": "cpu"})
        yield ClusterClient(serve.run(app, name="flide", route_prefix=None))
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_actors() -> list:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]


@pytest.mark.asyncio
async def test_sessions_on_a_ray_cluster_stay_exact_through_a_replica_kill(client, tiny_path):
    """8 sessions x 10 steps: each step equals a single engine's answer; after the routing settles a session
    stays on one replica, where its steps resume from checkpoints (the replicas' stats); a replica killed after
    step 5 loses nothing (its sessions continue elsewhere).
    Bounded: 240 s."""
    await asyncio.wait_for(run_sessions(client, tiny_path), 240)


async def run_sessions(client: ClusterClient, tiny_path) -> None:
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as single:
        sessions = [client.session() for _ in range(8)]
        texts = [""] * 8
        for step in range(10):
            if step == 5:
                ray.kill(replica_actors()[0])
            await step_all(sessions, texts, step, single)
            if step == 0:
                await asyncio.sleep(ROUTING_SETTLES_S)
            if step == 4:  # steps 2-5 resumed from checkpoints, each on its session's replica
                replicas = {stats["replica"]: stats for stats in
                            await asyncio.gather(*(session.replica_stats() for session in sessions))}
                assert all(session.replicas[-1] in replicas for session in sessions)
                assert sum(stats["checkpoint_hits"] for stats in replicas.values()) == 8 * 4
        for session in sessions:
            assert len(set(session.replicas[1:5])) == 1, f"steps 2-5 on one replica: {session.replicas}"
            assert len(set(session.replicas[6:])) == 1, f"steps 7-10 on one replica: {session.replicas}"
