"""Stop strings over streamed text: hold back what could be the start of a stop string."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            cut = min(i for i, _ in hits)
            out, self.pending = self.pending[:cut], ""
            return out, True
        keep = max((self._overlap(s) for s in self.stops), default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _overlap(self, stop: str) -> int:
        """Length of the longest suffix of pending text that is a proper prefix of `stop`."""
        for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:n]):
                return n
        return 0
