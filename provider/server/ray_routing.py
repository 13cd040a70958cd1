"""The request router of `intone serve --ray`: new connections go to the least loaded engine.

A module of its own because Ray imports a request router class by its path on every proxy and
handle, and subclassing Ray's router needs Ray at import time (ray_serve.py imports it lazily).
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, RequestRouter, RunningReplica


def replica_load(replica: RunningReplica) -> float:
    """The engine load the replica last reported (`record_routing_stats`), 0 if none yet."""
    stats = replica.routing_stats or {}
    return float(stats.get("load", 0.0))


class EngineLoadRouter(FIFOMixin, RequestRouter):
    """Routes each new connection or request to the replica with the least engine load.

    Loads are the replicas' `record_routing_stats` reports (every `routing_stats_period_s`).
    Replicas are tried one at a time, least loaded first, full ones (load >= 1) last; a replica
    at `max_ongoing_requests` refuses and Ray moves on to the next rank, so a full replica gets
    no new connection while another has room, whatever the staleness of the reports.
    """

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        # Random among equals: between two reports, ties would all go to the same replica.
        ranked = sorted(
            candidate_replicas,
            key=lambda r: (replica_load(r) >= 1.0, replica_load(r), random.random()),
        )
        return [[replica] for replica in ranked]
