"""The services environments call (a retrieval server, an OpenEnv server): an outage is waited out, not a failure.

`wait_out(call, service=..., retry_reason=..., wait=...)` calls `call()` until it answers. A failure that
`retry_reason` names (a refused connection, a 5xx answer: a server restarting, or overloaded) is tried again after a
pause that doubles from `first_pause` up to `max_pause`, until `wait` seconds have passed since the first failure; then
`ServiceUnavailable` says what was waited for, how long, and the last reason. Any other failure propagates at once:
an answer that is garbage or refused (4xx) would be the same again, and a timeout would hang again.

While it waits it says so, once when the outage starts and once when the service answers again, through the wait
reporter of the context it runs in: in an `EnvPool` worker, the pool (`gigpo_trl.env_pool`), which then gives the
step the time of the wait instead of taking it for a hang, and says once per batch of steps what its environments
waited for; elsewhere, the `gigpo_trl` logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger("gigpo_trl")

T = TypeVar("T")

DEFAULT_SERVICE_WAIT = 300.0  # seconds: a retrieval server loading an E5 index restarts in a minute or more
FIRST_PAUSE = 0.5
MAX_PAUSE = 15.0


class ServiceUnavailable(RuntimeError):
    """A service stayed unavailable for the whole wait: says which, how long it was waited for, and why."""


@dataclass(frozen=True)
class ServiceWait:
    """What a wait reporter hears: `service` (its name and address), `reason` (why the last call failed),
    `seconds_left`, how long the wait may still last (0 once the service answered again), and `call_timeout`, how long
    the call after it may take."""

    service: str
    reason: str
    seconds_left: float
    call_timeout: float = 0.0

    @property
    def message(self) -> str:
        if self.seconds_left == 0:
            return f"{self.service} answers again ({self.reason})"
        return f"{self.service} is unavailable ({self.reason}): waiting up to {self.seconds_left:.0f} s for it"


WaitReporter = Callable[[ServiceWait], None]

_reporter: contextvars.ContextVar[WaitReporter | None] = contextvars.ContextVar("gigpo_trl_wait_reporter", default=None)


@contextlib.contextmanager
def waits_reported_to(reporter: WaitReporter) -> Iterator[None]:
    """Within the block, `wait_out` reports its waits to `reporter` instead of the logger."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


def report_wait(wait: ServiceWait) -> None:
    """Tell this context's wait reporter (the `gigpo_trl` logger where none is set) of a wait."""
    reporter = _reporter.get()
    if reporter is None:
        logger.warning(wait.message)
    else:
        reporter(wait)


def wait_out(call: Callable[[], T], *, service: str, retry_reason: Callable[[Exception], str | None], wait: float,
             call_timeout: float = 0.0, first_pause: float = FIRST_PAUSE, max_pause: float = MAX_PAUSE,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
    """`call()`'s answer, outages of the service waited out (see the module docstring).

    Args:
        call: one request to the service.
        service: its name and address, as messages say it ("the retrieval server http://...").
        retry_reason: the reason an exception of `call` is worth another try (an outage), or None (raised at once).
        wait: seconds an outage is waited out in all, from its first failure (0: no second try).
        call_timeout: the longest one call may take, added to what the reporter is told the wait may still take.
        first_pause, max_pause: seconds before the second try, doubled before each next one up to `max_pause`.

    Raises:
        ServiceUnavailable: the service still failed `wait` seconds after its first failure (from the last failure).
    """
    if wait < 0 or first_pause < 0 or max_pause < first_pause:
        raise ValueError(f"wait >= 0 and 0 <= first_pause <= max_pause are needed, got {wait}, {first_pause}, {max_pause}")
    started, pause, reason = None, first_pause, None
    while True:
        try:
            answer = call()
        except Exception as exc:
            reason = retry_reason(exc)
            if reason is None:
                raise
            now = clock()
            if started is None:
                started = now
                report_wait(ServiceWait(service, reason, wait, call_timeout))
            left = started + wait - now
            if left <= 0:
                raise ServiceUnavailable(f"{service} is unavailable ({reason}), still after {now - started:.0f} s of "
                                         f"waiting (the wait's bound: {wait:g} s): is it running?") from exc
            sleep(min(pause, left))
            pause = min(2 * pause, max_pause)
            continue
        if started is not None:
            report_wait(ServiceWait(service, f"after {clock() - started:.1f} s", 0))
        return answer
