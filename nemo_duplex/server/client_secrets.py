"""Realtime client secrets: short-lived keys a server with API keys hands to a browser or app, so that it can open
Realtime calls without the real key (OpenAI's `POST /v1/realtime/client_secrets`, which the `openai` SDK calls as
`client.realtime.client_secrets.create`; docs/protocol.md, "Who may call").

A secret is minted with a real key, lives `expires_after.seconds` (10 s to 2 h, 600 by default) and opens any number
of Realtime calls (or resumes them) until then; a call it opened goes on after it expires, and it still resumes
that call (CallConnection.opened_with). It is good for
`/v1/realtime` only: not for minting more, not for `/generate`, not for `/metrics`. The session settings given
with it are the calls' starting settings, which a `session.update` may still change. At most
`serve.max_client_secrets` are live at once: a mint past that is refused (429), not the oldest dropped. With
`serve.replicas` > 1 a secret lives on the replica that minted it and names it (`ek_<replica>.<random>`); Serve's
proxy sends the calls it opens there (server/replicas.py, ReplicaRoute)."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from nemo_duplex.runtime import SettingsError
from nemo_duplex.server.errors import Refusal
from nemo_duplex.server.realtime_protocol import ProtocolError, SessionSettings
from nemo_duplex.server.resume import Parking

PREFIX = "ek_"
SECONDS = (10, 7200)      # OpenAI's range for expires_after.seconds
DEFAULT_SECONDS = 600


@dataclass(frozen=True)
class ClientSecret:
    value: str
    expires_at: float           # seconds since the epoch (what the client is told)
    expires_mono: float         # time.monotonic() (what the server goes by)
    settings: SessionSettings   # the calls' starting settings


def expiry_seconds(expires_after: object) -> int:
    """`expires_after` of a mint request ({anchor: "created_at", seconds}; absent: 600 s), checked."""
    if expires_after is None:
        return DEFAULT_SECONDS
    if not isinstance(expires_after, dict):
        raise ProtocolError("invalid_event", "expires_after must be an object", "expires_after")
    if expires_after.get("anchor", "created_at") != "created_at":
        raise ProtocolError("invalid_event", "expires_after.anchor: only 'created_at' exists", "expires_after.anchor")
    seconds = expires_after.get("seconds", DEFAULT_SECONDS)
    low, high = SECONDS
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise ProtocolError("invalid_event", f"expires_after.seconds {str(seconds)[:20]}: an integer in "
                            f"[{low}, {high}]", "expires_after.seconds")
    return seconds


class ClientSecrets:
    """The live client secrets of one server."""

    def __init__(self, max_secrets: int):
        if max_secrets < 0:
            raise SettingsError(f"serve.max_client_secrets = {max_secrets}: >= 0 (0: none may be minted)")
        self.max_secrets = max_secrets
        self._live: dict[str, ClientSecret] = {}
        self.route = ""   # behind Serve's proxy, this replica's id, in every value: its calls are sent here (replicas.py)

    def mint(self, settings: SessionSettings, seconds: int) -> ClientSecret:
        self._purge()
        if len(self._live) >= self.max_secrets:
            raise Refusal("too_many_client_secrets", f"{len(self._live)} client secrets are live; the limit is "
                          f"serve.max_client_secrets = {self.max_secrets}", 429)
        value = PREFIX + Parking.new_token(self.route)   # (routed as a resume token is: ReplicaRoute.route)
        secret = ClientSecret(value, time.time() + seconds, time.monotonic() + seconds, copy.deepcopy(settings))
        self._live[value] = secret
        return secret

    def get(self, key: str | None) -> ClientSecret | None:
        """The live secret `key` is, if it is one."""
        if not key or not key.startswith(PREFIX):
            return None
        secret = self._live.get(key)
        if secret is None:
            return None
        if time.monotonic() >= secret.expires_mono:
            del self._live[key]
            return None
        return secret

    def _purge(self) -> None:
        now = time.monotonic()
        for value in [v for v, s in self._live.items() if now >= s.expires_mono]:
            del self._live[value]
