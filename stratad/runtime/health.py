"""The daemon's health in one body, built in one place from the scheduler's state.

HTTP /health serves it (200 while it serves, 503 otherwise) and the control socket's status
reply carries the same struct, so a load balancer and `stratactl status` never disagree.
"""

from __future__ import annotations

from stratad.protocol import Health, HealthStatus
from stratad.runtime.scheduler import Scheduler

_STATUS: dict[str, HealthStatus] = {
    "loading": "loading",
    "ready": "ok",
    "draining": "draining",
    "failed": "failed",
}


def health_of(
    scheduler: Scheduler, model: str | None, degraded: str | None = None, pinning: bool = False
) -> Health:
    """`degraded`: why a daemon that serves does so short of its configuration (else None);
    `pinning`: the daemon pins its resident set while the model loads (`loading` until then
    said nothing of it)."""
    s = scheduler
    status: HealthStatus = _STATUS.get(s.state, "failed")
    reason: str | None = None
    if (status == "ok" and s.held == "pinning") or (status == "loading" and pinning):
        status = "pinning"
    elif status == "ok" and degraded:
        status, reason = "degraded", degraded
    elif status == "draining":
        reason = s.drain_reason
    return Health(status=status, model=model, running=s.num_running, waiting=s.waiting,
                  reason=reason)  # fmt: skip
