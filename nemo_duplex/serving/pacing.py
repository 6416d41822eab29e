"""When to step: the pacing rules of the engine's loop (engine.coalesce_ms, open_quiet_ms, max_duty), as
pure functions of each live call's (arrival of its oldest pending frame, arrival of its last frame, frames
pending). The engine's `_coalesce` applies them; tests/test_engine.py checks them one by one."""
from __future__ import annotations

import bisect


def coalesce_limit(coalesce_s: float, last_step: tuple[float, float] | None) -> float:
    """The coalescing bound: engine.coalesce_ms, but never longer than the last step took. Why: with
    staggered callers some frame is always due soon, so every step was held until its oldest frame was
    coalesce_ms old and the worst frame waited the bound and then its own step (H200 load run 10, 32
    staggered calls: ~6 calls a step, 14 ms steps, p99 30.8 ms = 15 + 14 + 1.8 host). A frame held past one
    step time would have been served as soon by stepping now and again for the late ones; lockstep
    frames arrive within a few ms, well inside one step."""
    if coalesce_s <= 0:
        return 0.0
    return coalesce_s if last_step is None else min(coalesce_s, last_step[1])


def coalesce_deadline(calls: list[tuple[float | None, float | None, int]], limit: float) -> float | None:
    """When a step held for coalescing must start: the arrival of the oldest frame pending alone in its
    call (a paced frame) plus `limit`; None with no paced frame (calls as for coalesce_wait)."""
    paced = [oldest for oldest, _, pending in calls if pending == 1 and oldest is not None]
    return min(paced) + limit if paced else None


def coalesce_wait(calls: list[tuple[float | None, float | None, int]], now: float, limit: float,
                  frame_s: float) -> float:
    """How long to hold a step so that frames due together share it; 0 = step now.

    calls: per live call (arrival time of its oldest pending frame or None, arrival time of its last frame
    or None, frames pending). A call without a pending frame is waited for when its next frame is due (its
    last arrival plus one frame period) before the bound: the arrival of the oldest frame pending alone
    in its call, plus `limit`. So callers that send in lockstep are stepped together even when their
    frames reach the engine ~10 ms apart, while with staggered callers a step waits only for frames due
    within the bound, and a step whose frames are already older than the bound (the engine was busy)
    never waits. A call with a backlog (an upload being fed, or a call that fell behind) neither sets the
    bound nor is waited for: its frames are not paced, and its old frames would otherwise turn
    coalescing off for everyone while an upload runs. A call that has not sent a frame yet has no rhythm
    to go by and is not waited for, nor is one whose next frame is a period late (frame_due)."""
    deadline = coalesce_deadline(calls, limit)
    if deadline is None or now >= deadline:
        return 0.0
    due = any(frame_due(last, pending, deadline, frame_s, now) for _, last, pending in calls)
    return deadline - now if due else 0.0


def duty_wait(calls: list[tuple[float | None, float | None, int]], now: float,
              last_step: tuple[float, float] | None, max_duty: float, cap: float) -> float:
    """How long to hold a step so that the engine's duty stays <= max_duty; 0 = step now (engine.max_duty).

    calls: per live call as for coalesce_wait; the caller asks only while some live call has no frame
    pending. last_step: (start, seconds) of the previous step. The next step may start at
    start + seconds / max_duty, but no paced frame (the oldest of a call with exactly one pending) waits
    past its arrival + cap; with no paced frame pending (only backlogs, or nothing) there is no hold."""
    if max_duty <= 0 or last_step is None:
        return 0.0
    paced = [oldest for oldest, _, pending in calls if pending == 1 and oldest is not None]
    if not paced:
        return 0.0
    start, seconds = last_step
    until = min(start + seconds / max_duty, min(paced) + cap)
    return max(0.0, until - now)


def opened_together(opened_at: float, first_frame_opens: list[float], limit: float) -> bool:
    """A call without a frame yet has no rhythm; until its first frame its open time stands for its
    phase: it is waited for (within the coalescing bound) when it opened within `limit` of a call whose
    first frame is pending. Callers that start together open together, then send their first frames
    together (scripts/bench.py connects 1 s before the schedule starts), and the first step took only
    the first frames already in: H200 load run 10, 32 lockstep calls, 7 first frames in the first step
    and 25 a step later at 33-36 ms lag, the run's p99. Staggered callers open tens of ms apart.
    first_frame_opens: sorted (a bisection, not a scan: 160 calls opening together ask 160 times)."""
    i = bisect.bisect_left(first_frame_opens, opened_at - limit)
    return i < len(first_frame_opens) and first_frame_opens[i] <= opened_at + limit


def frame_due(last: float | None, pending: int, deadline: float, frame_s: float, now: float) -> bool:
    """A call with no frame pending whose next frame (its last arrival + one period) is due by `deadline`
    and is late by less than one period at `now`: the calls coalescing waits for. Why the second rule: a
    call that went quiet (a push-to-talk client between turns, a connection lost and parked for a resume,
    a client that stalls on purpose) would otherwise hold every other call's step up to the bound for as
    long as it stays quiet; a frame a period late is no longer in the lockstep rhythm coalescing is for."""
    return pending == 0 and in_rhythm(last, now, frame_s) and last + frame_s <= deadline


def in_rhythm(last: float | None, now: float, frame_s: float) -> bool:
    """A call whose next frame (its last arrival + one period) is late by less than one period at `now`."""
    return last is not None and now - last < 2 * frame_s


def step_gap(calls: list[tuple[float | None, float | None, int]], now: float, frame_s: float) -> float:
    """Seconds until the next step of paced calls is due (calls as for coalesce_wait; the engine adds that a
    step under way leaves no gap): 0 while a paced frame (one pending) waits for its step, else until the
    first next frame of a call in its rhythm is due; inf with no such call. Calls with a backlog do not
    count: the engine steps them in the gaps itself (backlog_hold), or with the paced calls."""
    if any(pending == 1 for _, _, pending in calls):
        return 0.0
    due = [last + frame_s for _, last, pending in calls if pending == 0 and in_rhythm(last, now, frame_s)]
    return max(0.0, min(due) - now) if due else float("inf")


def backlog_hold(calls: list[tuple[float | None, float | None, int]], now: float, frame_s: float,
                 backlog_step_s: float) -> float:
    """How long to hold a step that would take only backlogs (calls with more than one frame pending: an
    upload being fed, a call admitted with its audio already in, a call that fell behind) so that it does
    not run into the paced calls' next frames; 0 = step now.

    calls: as for coalesce_wait; backlog_step_s: what such a step takes (the engine's last step of as
    many rows). Between two steps of the paced calls the backlogs step on their own, a frame each per step
    (catching up faster than real time whenever such a step is shorter than a frame period), but only
    while one ends before the first paced call's next frame is due: started later, it makes that frame
    wait for it, and the paced frames that arrive meanwhile are split over the next steps. Held, the
    backlogs ride along in the paced calls' step. No hold while a paced frame is pending (coalesce_wait
    decides then) or with no paced call. (H200, 128 lockstep calls while calls with 2 s of audio in are
    admitted twice a second: live lag p99 1.32x the run without arrivals before this rule, 1.27-1.40x in
    three runs with it: no effect beyond the runs' spread; docs/performance.md.)"""
    if any(pending == 1 for _, _, pending in calls) or not any(pending > 1 for _, _, pending in calls):
        return 0.0
    due = [last + frame_s for _, last, pending in calls if pending == 0 and last is not None]
    if not due or now + backlog_step_s <= min(due):
        return 0.0
    return max(0.0, min(due) - now)
