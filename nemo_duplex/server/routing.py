"""Serve's request router for the replicas (server/replicas.py): a call goes to the replica with the most free
places. A module of its own because Serve imports the router by its path, in its proxy; only
`serve.replicas > 1` imports it (and Ray)."""
from __future__ import annotations

from ray.serve.request_router import FIFOMixin, RequestRouter


class MostFreePlaces(FIFOMixin, RequestRouter):
    """Every live replica in one rank: Serve probes each one's requests in flight and takes the lowest, which
    (every replica having the same engine.max_calls) is the one with the most free places. Serve's default,
    power of two choices, compares two random replicas and could refuse a call while another has places."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        return [list(candidate_replicas)] if candidate_replicas else []
