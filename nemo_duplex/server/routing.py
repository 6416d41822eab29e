"""Serve's request router for the replicas (server/replicas.py): a call goes to the replica with the most free
places, a resumed call to the replica that holds it. A module of its own because Serve imports the router by its
path, in its proxy; only `serve.replicas > 1` imports it (and Ray)."""
from __future__ import annotations

from ray.serve.request_router import FIFOMixin, RequestRouter


def ranks(candidates: list, holder: str) -> list[list]:
    """The candidates in one rank, or, where one of them is `holder` (a replica id: the route of a resume token or
    a client secret, which the proxy's ReplicaRoute gives as the request's session id), that one alone."""
    held = [r for r in candidates if holder and r.replica_id.unique_id == holder]
    return [held] if held else [list(candidates)] if candidates else []


class MostFreePlaces(FIFOMixin, RequestRouter):
    """Every live replica in one rank: Serve probes each one's requests in flight and takes the lowest, which
    (every replica having the same engine.max_calls) is the one with the most free places. Serve's default,
    power of two choices, compares two random replicas and could refuse a call while another has places. A
    resume goes to the replica that holds its call; if that one is gone, to any (which answers 404)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        holder = pending_request.metadata.session_id if pending_request is not None else ""
        return ranks(list(candidate_replicas), holder)
