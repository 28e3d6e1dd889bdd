"""Background threads that must be out of torch's C++ code before the interpreter finalizes.

aiak's daemon threads (the comm worker, the prefetcher) call into torch with the GIL released: a gloo
collective's ``wait()``, ``Future.set_result``, a loader's ``next()``. A daemon thread that takes the GIL back
after finalization has begun is ended with ``pthread_exit``; its forced unwinding crosses pybind11's GIL guard,
a ``noexcept`` destructor, and the whole process aborts ("terminate called without an active exception",
SIGABRT), so torchrun reports a rank that finished its work as failed. The window is the last bucket's
``set_result``: the training loop sees the future done and the script exits while the worker is still
returning from C++.

Owners registered here are stopped by one ``atexit`` handler, which Python runs before finalization; each
``stop_for_exit()`` lets its thread finish what it is doing and joins it, with a bound.
"""
from __future__ import annotations

import atexit
import weakref

_OWNERS: "weakref.WeakSet" = weakref.WeakSet()


def stop_at_exit(owner) -> None:
    """Call ``owner.stop_for_exit()`` at interpreter exit, if ``owner`` is still alive then."""
    _OWNERS.add(owner)


def _stop_all() -> None:
    for owner in list(_OWNERS):
        try:
            owner.stop_for_exit()
        except Exception:  # noqa: BLE001 - exiting anyway; one owner's failure must not skip the others
            pass


atexit.register(_stop_all)
