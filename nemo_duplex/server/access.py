"""Who may call: API keys and the browser origins allowed to open calls.

Keys (`serve.api_keys`, or `serve.api_keys_file` with one key a line) are off by default, when the server
binds to loopback only. With keys, every call route and `/metrics` wants one, as `Authorization: Bearer <key>`
(what the OpenAI SDKs send) or, from a browser, which cannot set headers on a WebSocket, as the subprotocol
`openai-insecure-api-key.<key>` beside `realtime` (what OpenAI's browser client offers). A Realtime call also
takes a live client secret minted with a key (server/client_secrets.py), so that a browser never holds the key.
`/health`, the page and its files stay open: a load balancer and the page's first load need them.

Origins: a browser sends `Origin` with every WebSocket upgrade and POST, and any page the user visits could
otherwise open calls to a server on their machine. A request without `Origin` (not a browser), from the
server's own origin (the page at `/`), or from one of `serve.allowed_origins` ("*": any) is let in; others
are refused with 403 before the upgrade.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers

from nemo_duplex.server.errors import Refusal

log = logging.getLogger(__name__)
KEY_SUBPROTOCOL = "openai-insecure-api-key."
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Access:
    keys: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg) -> Access:
        keys = [k for k in cfg.api_keys if k]
        if cfg.api_keys_file:
            path = Path(cfg.api_keys_file)
            if not path.is_file():
                raise FileNotFoundError(f"serve.api_keys_file={path}: no such file")
            keys += [line.strip() for line in path.read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
        if not keys and cfg.host not in LOOPBACK:
            log.warning("serve.host=%s without serve.api_keys: anyone who can reach this port may open calls",
                        cfg.host)
        return cls(tuple(keys), tuple(cfg.allowed_origins))

    @staticmethod
    def key(headers: Headers) -> str | None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        for proto in headers.get("sec-websocket-protocol", "").split(","):
            if proto.strip().startswith(KEY_SUBPROTOCOL):
                return proto.strip()[len(KEY_SUBPROTOCOL):]
        return None

    def refusal(self, headers: Headers, scheme: str, client_secrets=None, also: str | None = None) -> Refusal | None:
        """Why this request may not call (None: it may). `scheme`: http or ws, for the same-origin check;
        `client_secrets` (server/client_secrets.py): where a live client secret stands for a key (a Realtime call);
        `also`: one more key that is good here (the secret that opened a call, for its resume)."""
        if self.keys:
            key = self.key(headers)
            if key is None:
                return Refusal("unauthorized", "an API key is required (Authorization: Bearer <key>, or the "
                               f"WebSocket subprotocol {KEY_SUBPROTOCOL}<key>)", 401)
            if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.keys + ((also,) if also else ())) \
                    and (client_secrets is None or client_secrets.get(key) is None):
                return Refusal("unauthorized", "the API key is not one of serve.api_keys" + (
                    " nor a live client secret" if client_secrets is not None else ""), 401)
        origin = headers.get("origin")
        if origin is None or "*" in self.origins or origin in self.origins:
            return None
        host = headers.get("host", "")
        if origin in (f"http://{host}", f"https://{host}"):   # the page this server serves
            return None
        return Refusal("origin_not_allowed", f"Origin {origin[:100]!r} is not this server's nor one of "
                       "serve.allowed_origins", 403)

    @staticmethod
    def subprotocol(headers: Headers) -> str | None:
        """The subprotocol to accept: a browser that offered some needs one back; the key's is never echoed."""
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        named = [p for p in offered if not p.startswith(KEY_SUBPROTOCOL)]
        return named[0] if named else None
