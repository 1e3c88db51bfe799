"""Which lane is in front this step, and how much of a step the lanes behind it get.

Strict lane priority protects nothing on a machine where a step is long: a batch
backlog in the running batch makes every step long, and an interactive request that
arrives waits for the step in flight, then runs in a step as long. So while a lane
has work (or had it within `hold_seconds`), it is the *foreground*: the lanes below it
(the *background*) share a slice of each step, `tokens` tokens of the dearer kind
(decoded or prompt) or as many of the cheaper kind as cost the same, and are
guaranteed it, so they never starve. The share is not a guess made once: a cost
model fitted to the last steps' measured times (`StepCost`: a fixed cost, a cost per
decoded token and one per prompt token) sizes it so that the background adds about
`target_seconds` to a step, on whatever device this is (a few tokens on a small CPU,
hundreds on a GPU).

Plain data: no clock of its own, no tensors.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..request import Lane


@dataclass(frozen=True)
class Split:
    """This step's classes: lanes <= `top` are the foreground, the rest the background,
    which may add `background_units` of cost to the step (in units of its dearer kind of
    token: a decoded token costs `decode_weight` units, a prompt token `prompt_weight`)
    and at most `max_tokens` tokens."""

    top: int
    background_units: float
    max_tokens: int
    decode_weight: float = 1.0
    prompt_weight: float = 1.0

    def is_background(self, lane: int) -> bool:
        return lane > self.top

    @property
    def background_tokens(self) -> int:
        """The most tokens the background can use (all of its cheaper kind)."""
        cheapest = min(self.decode_weight, self.prompt_weight)
        return min(self.max_tokens, int(self.background_units / cheapest + 1e-9))


@dataclass(frozen=True)
class CostModel:
    """Seconds of a step: fixed + per_decode x decoded tokens + per_prompt x other tokens."""

    fixed: float
    per_decode: float
    per_prompt: float

    def break_even(self, decoded: int, prompt: int) -> float:
        """The acceptance rate above which one more drafted token shortens the time per
        output token of a step planned with `decoded` decodes and `prompt` other tokens."""
        step = self.fixed + self.per_decode * decoded + self.per_prompt * prompt
        return self.per_prompt * max(decoded, 1) / step if step > 0 else 0.0


class StepCost:
    """Least squares over the last `window` steps: seconds = fixed + per_decode * decoded
    tokens + per_prompt * prompt tokens. Running sums make each step O(1); they are
    rebuilt from the window once per `window` steps so rounding cannot pile up."""

    def __init__(self, window: int = 64) -> None:
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._sums = [0.0] * 9  # n, d, p, t, dd, pp, dp, dt, pt
        self._since_rebuild = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, decoded: int, prompt: int, seconds: float) -> None:
        if len(self._rows) == self._rows.maxlen:
            self._accumulate(self._rows[0], -1.0)
        row = (float(decoded), float(prompt), seconds)
        self._rows.append(row)
        self._accumulate(row, 1.0)
        self._since_rebuild += 1
        if self._since_rebuild >= (self._rows.maxlen or 1):
            self._sums = [0.0] * 9
            for r in self._rows:
                self._accumulate(r, 1.0)
            self._since_rebuild = 0

    def _accumulate(self, row: tuple[float, float, float], sign: float) -> None:
        d, p, t = row
        for i, v in enumerate((1.0, d, p, t, d * d, p * p, d * p, d * t, p * t)):
            self._sums[i] += sign * v

    def model(self) -> CostModel | None:
        """The fitted model, fixed cost included; None until `slopes()` has an answer."""
        slopes = self.slopes()
        if slopes is None:
            return None
        n, sd, sp, st = self._sums[:4]
        fixed = (st - slopes[0] * sd - slopes[1] * sp) / n
        return CostModel(max(fixed, 0.0), max(slopes[0], 0.0), max(slopes[1], 0.0))

    def slopes(self) -> tuple[float, float] | None:
        """(seconds per decoded token, seconds per prompt token), None until the steps seen
        vary enough to tell the fixed cost from the per-token ones."""
        if len(self._rows) < 8:
            return None
        n, sd, sp, st, sdd, spp, sdp, sdt, spt = self._sums
        # Centred normal equations (the fixed cost drops out): a 2x2 system in the slopes.
        cdd, cpp, cdp = sdd - sd * sd / n, spp - sp * sp / n, sdp - sd * sp / n
        cdt, cpt = sdt - sd * st / n, spt - sp * st / n
        eps = 1e-9 * (1.0 + sdd + spp)  # what rounding leaves of a variance that is zero
        det = cdd * cpp - cdp * cdp
        if cdd > eps and cpp > eps and det > 1e-9 * cdd * cpp:
            slopes = ((cpp * cdt - cdp * cpt) / det, (cdd * cpt - cdp * cdt) / det)
        elif cdd > eps or cpp > eps:  # one kind of token only: one slope over all of them
            cxx = cdd + cpp + 2 * cdp
            if cxx <= eps:
                return None
            one = (cdt + cpt) / cxx
            slopes = (one, one)
        else:
            return None
        return slopes if max(slopes) > 0 and all(math.isfinite(x) for x in slopes) else None


class LaneGuard:
    """Contract: `split(busy, now)` is called once per step with the lanes that have work
    (running or waiting, by the lane each request asked for); it returns None when one
    lane is all there is (no budget split), else the step's `Split`. `observe(...)`
    reports each executed step's decoded and prompt tokens and how long it took; the
    background's share follows."""

    def __init__(self, hold_seconds: float, target_seconds: float, max_batched_tokens: int,
                 initial_tokens: int = 16) -> None:
        self.hold_seconds = hold_seconds
        self.target_seconds = target_seconds
        # The foreground keeps at least half of every step (a budget of one token is all
        # the foreground's).
        self.max_tokens = max_batched_tokens // 2
        self.min_tokens = min(1, self.max_tokens)
        # Until the steps have been measured: small, so a long step is not the first thing
        # an interactive arrival meets on a slow device.
        self.tokens = max(self.min_tokens, min(self.max_tokens, initial_tokens))
        # Relative costs of the two kinds of token, the dearer one 1 (equal until measured).
        self.decode_weight = self.prompt_weight = 1.0
        self.cost = StepCost()
        self._last_busy = [-math.inf] * len(Lane)

    def split(self, busy: Iterable[int], now: float) -> Split | None:
        busy = set(busy)
        for lane in busy:
            self._last_busy[lane] = now
        if not busy:
            return None
        held = [lane for lane in Lane if now - self._last_busy[lane] <= self.hold_seconds]
        top = min(held, default=min(busy))
        if not any(lane > top for lane in busy):
            return None
        return Split(top, float(self.tokens), self.max_tokens, self.decode_weight, self.prompt_weight)

    def observe(self, decoded: int, prompt: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        self.cost.add(decoded, prompt, seconds)
        slopes = self.cost.slopes()
        if slopes is None:
            return
        unit = max(slopes)
        self.tokens = max(self.min_tokens, min(self.max_tokens, int(self.target_seconds / unit)))
        # A slope lost in the noise (or negative) must not make that kind of token free.
        self.decode_weight, self.prompt_weight = (max(0.1, x / unit) for x in slopes)
