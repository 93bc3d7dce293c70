"""Plain helpers for speculation tests (fixtures live in conftest.py)."""

from __future__ import annotations

from foretell.spec import RowDraft


class RecordingRows:
    """Drafter rows (plugin API 2) that remember every token each row was fed and propose
    nothing useful."""

    def __init__(self) -> None:
        self.heard: list[list[int]] = []

    def append(self, rows):
        self.heard.extend(list(r.feed.tokens) for r in rows)

    def filter(self, keep):
        self.heard = [self.heard[i] for i in keep]

    def draft(self, feeds, lengths):
        for row, feed in zip(self.heard, feeds):
            row.extend(feed.tokens)
        return RowDraft.of([[0] * n for n in lengths])

    def commit(self, accepted):
        pass

    def capture(self, row):
        return None

    def close(self):
        self.heard = []
