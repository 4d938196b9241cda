"""What a verify step costs against a step without drafts, measured while the engine runs.

Drafts pay only when the tokens a verify step keeps outnumber the plain steps it costs: on
an H200 a batch-expanded verify step of the 7B shape costs about 1.3 one-token steps, on a
CPU several (every row is computed). The meter keeps a smoothed period of each kind of step
(the time from one step's tokens reaching the host to the next's), and the decoder pauses a
request whose accepted drafts per verify step fall below what the step costs.
"""

from __future__ import annotations

# Weight of the newest period in each smoothed mean.
SMOOTHING = 0.1
# A period this many times the smoothed one is an idle gap (no requests), not a step.
IDLE_GAP = 8.0


class StepCostMeter:
    """Smoothed periods of plain and verify steps; `ratio` is verify over plain (>= 1)."""

    def __init__(self) -> None:
        self.plain_s: float | None = None
        self.verify_s: float | None = None

    def observe(self, seconds: float, *, verify: bool) -> None:
        """Count one step period of the given kind."""
        mean = self.verify_s if verify else self.plain_s
        if mean is None:
            mean = seconds
        elif seconds > IDLE_GAP * mean:
            return
        else:
            mean += SMOOTHING * (seconds - mean)
        if verify:
            self.verify_s = mean
        else:
            self.plain_s = mean

    @property
    def ratio(self) -> float:
        """Plain steps one verify step costs; 1 until both kinds have been seen."""
        if not self.plain_s or self.verify_s is None:
            return 1.0
        return max(1.0, self.verify_s / self.plain_s)
