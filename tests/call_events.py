"""A call's events as a test sees them: `on_event=recorder` for a call opened on an engine, then its frames,
how it ended, and an Event set when it has."""
import threading

from nemo_duplex.serving.calls import EndedEvent, FrameEvent


class CallEvents:
    def __init__(self):
        self.events: list = []
        self.ended = threading.Event()   # set at the call's EndedEvent

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if isinstance(ev, EndedEvent):
            self.ended.set()

    @property
    def frames(self) -> list[FrameEvent]:
        return [e for e in self.events if isinstance(e, FrameEvent)]

    @property
    def endings(self) -> list[tuple[str, str]]:
        """(reason, message) of each EndedEvent (one, for a call that ended once)."""
        return [(e.reason, e.message) for e in self.events if isinstance(e, EndedEvent)]
