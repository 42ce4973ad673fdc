"""How a run stops: SIGINT and SIGTERM as one clean interrupt, and workers that never outlive their parent."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Frames where a raised KeyboardInterrupt cannot propagate: Python prints it as "Exception ignored
# in ..." with a traceback and drops it (Hypothesis runs a gc callback around every example).
_UNRAISABLE = frozenset({"gc_callback", "__del__"})
PARENT_POLL_SECONDS = 0.5
ORPHAN_GRACE_SECONDS = 30.0  # an orphaned worker's time to save its best shrink before it exits anyway


def in_unraisable_context(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name in _UNRAISABLE:
            return True
        frame = frame.f_back
    return False


class Interrupts:
    """A handler for SIGINT and SIGTERM: both raise KeyboardInterrupt, which the runner and the session
    already turn into "stop, keep the best shrink, print the summary".

    ``signum`` is the first signal taken (the exit status is 128 + it). With ``once`` later signals
    are ignored (a worker saving its artifact is not interrupted again). A signal that lands in a gc
    callback or ``__del__`` is re-sent a moment later instead of being printed and lost.
    """

    def __init__(self, *, once: bool = False):
        self.once = once
        self.signum: int | None = None
        self.resend = lambda signum: threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()

    def __call__(self, signum, frame):
        if in_unraisable_context(frame):
            self.resend(signum)
            return
        if self.signum is not None and self.once:
            return
        if self.signum is None:
            self.signum = signum
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self):
        """Handle the stop signals while the block runs (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def stop_signals_blocked():
    """Block SIGINT and SIGTERM while worker processes start. A spawned worker inherits the mask, so
    a Ctrl-C during its seconds of imports stays pending until :func:`worker_ready` unblocks it
    inside its handler, instead of killing it or printing a KeyboardInterrupt traceback. The parent
    takes its own pending signal when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def stop_signals_deferred():
    """Hold SIGINT and SIGTERM while the block runs, then deliver the first one taken to the handler
    that was installed before. A signal mask would not do: it is per thread, and the kernel hands a
    process-directed signal to any thread that does not block it (torch's pool threads), whose
    Python handler then still raises in the main thread. Outside the main thread this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: taken.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if taken:
            signal.raise_signal(taken[0])


def worker_ready() -> None:
    """Unblock the stop signals a worker inherited blocked (call inside its KeyboardInterrupt handler)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _set_parent_death_signal(signum: int) -> None:
    """Linux: the kernel sends ``signum`` when the parent dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the polling thread below still catches it


def watch_parent(parent_pid: int, on_orphaned=None) -> None:
    """Stop this worker when its parent is gone: SIGTERM (the handler saves the best shrink), then
    a hard exit if it is still running after ORPHAN_GRACE_SECONDS. No worker fuzzes on unowned."""
    _set_parent_death_signal(signal.SIGTERM)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        if on_orphaned is not None:
            on_orphaned()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_SECONDS)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="poolfuzz-parent-watch", daemon=True).start()
