"""What the server turns down, and how a connection ends badly (docs/protocol.md lists every code)."""
from __future__ import annotations

from dataclasses import dataclass


class Refusal(Exception):
    """A request we turn down; `code` is the documented error code, `status` the HTTP status."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass
class Fatal:
    """The last thing a connection gets: an error, then the socket closes."""
    code: str
    message: str


# Refusals that end the call (the others are reported and the call goes on).
FATAL_CODES = {"busy", "input_budget_exceeded", "not_ready"}
