"""The target's hidden states of a batch's last steps, for drafters that read them.

:class:`StepHidden` keeps each step's states once for every row of the batch (not sliced out
row by row); :class:`~foretell.spec.batch.DraftGroup` reads a row's out when its drafter is
fed.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from foretell.spec.contract import CATCH_UP_MAX


class StepHidden:
    """The target's hidden states of a batch's last steps, kept once a step (not sliced out
    row by row) for the rows whose drafter reads them (:data:`~foretell.spec.PORT_HIDDEN`);
    a row's are read out only when its drafter is fed (:meth:`newest`).

    A row's feed carries the states of its newest :data:`CATCH_UP_MAX` tokens at most (a
    drafter further behind starts over from those, :class:`~foretell.spec.Feed`), and every
    step gives every row at least one token, so the last ``CATCH_UP_MAX`` steps hold them,
    and one more: a pipelined step's newest state belongs to a token not read yet."""

    def __init__(self) -> None:
        #: ``(hidden [B, w, H], the batch's rows then, kept per row or None)`` per step.
        self._steps: collections.deque[tuple[mx.array, Sequence[Any], Sequence[int] | None]] \
            = collections.deque(maxlen=CATCH_UP_MAX + 1)
        #: Steps recorded so far: the next step's number.
        self.serial = 0

    def record(self, hidden: mx.array, rows: Sequence[Any],
               kept: Sequence[int] | None = None) -> None:
        """One step's ``hidden`` over ``rows`` (row ``b``'s states are ``hidden[b]``; rows
        join a batch only at its end, so the batch's own list may be given): its first
        ``kept[b]`` positions predicted the tokens row ``b`` kept; ``kept`` None: a step of
        one position that every row kept."""
        self._steps.append((hidden, rows, kept))
        self.serial += 1

    def clear(self) -> None:
        self._steps.clear()

    def newest(self, wanted: Sequence[tuple[Any, int, int, bool]]) -> list[mx.array | None]:
        """Per ``(row, since, n, unread)``: the states ``[1, m, H]`` that predicted the
        row's ``n`` newest tokens, ``m = min(n, CATCH_UP_MAX)``, from the steps numbered
        ``since`` on (None when ``n`` is 0); ``unread``: the row's newest state is that of a
        token it has not read yet, left out."""
        runs = self._runs(min((since for _, since, n, _ in wanted if n), default=self.serial))
        where: dict[int, dict[int, int]] = {}
        out: list[mx.array | None] = []
        for row, since, n, unread in wanted:
            want = min(n, CATCH_UP_MAX)
            if want <= 0:
                out.append(None)
                continue
            parts: list[mx.array] = []
            got = 0
            for first, end, hidden, rows, kept in reversed(runs):
                if got >= want + unread or end <= since:
                    break
                index = where.get(id(rows))
                if index is None:
                    index = where[id(rows)] = {id(r): b for b, r in enumerate(rows)}
                b = index[id(row)]
                part = hidden[b : b + 1, max(since - first, 0) :] if kept is None \
                    else hidden[b : b + 1, : kept[b]]
                parts.append(part)
                got += part.shape[1]
            if not parts:  # not recorded (the batch was rebuilt): the drafter hears none
                out.append(None)
                continue
            parts.reverse()
            joined = joined_states(parts)
            if unread:
                joined = joined[:, :-1]
            out.append(joined if joined.shape[1] == want else joined[:, -want:])
        return out

    def _runs(self, since: int) -> list[tuple[int, int, mx.array, Sequence[Any],
                                             Sequence[int] | None]]:
        """The steps from ``since`` on as ``(first, end, hidden, rows, kept)``: one-position
        steps over the same rows joined into one array (a long plain stretch costs one
        concatenate, not one slice per row and step), each other step alone."""
        runs: list[list[Any]] = []
        first = self.serial - len(self._steps)
        for serial, (hidden, rows, kept) in enumerate(self._steps, start=first):
            if serial < since:
                continue
            last = runs[-1] if runs else None
            if (kept is None and last is not None and last[4] is None and last[3] is rows
                    and last[2][-1].shape[0] == hidden.shape[0]):
                last[1] = serial + 1
                last[2].append(hidden)
            else:
                runs.append([serial, serial + 1, [hidden], rows, kept])
        return [(a, b, joined_states(parts), rows, kept) for a, b, parts, rows, kept in runs]


def joined_states(parts: list[mx.array]) -> mx.array | None:
    """``[1, m, H]`` parts (oldest first) as one array along the positions; None for none."""
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
