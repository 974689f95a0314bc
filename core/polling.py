"""How long a loop that waits for something another process writes sleeps before it looks again.

The loop's waits are mostly a fraction of a second: a trainer waiting for its next step's groups,
a sampler waiting for the reload its next groups need. Each look's delay is paid every step, so
the first two seconds of a wait are looked at every FAST_S (after FIRST_S, growing with the wait);
a wait longer than that (slow environments, a stopped sampler) backs off to the caller's `slow_s`,
so a run waiting minutes does not list its storage twenty times a second (measured in
docs/pipeline.md, "Trainer and vLLM on the same CPU cores")."""

from __future__ import annotations

FIRST_S = 0.02
FAST_S = 0.05
FAST_FOR_S = 2.0


def poll_delay(waited_s: float, slow_s: float) -> float:
    """Seconds to sleep before the next look, `waited_s` into a wait."""
    if waited_s < FAST_FOR_S:
        return min(FAST_S, slow_s, max(FIRST_S, waited_s))
    return slow_s
