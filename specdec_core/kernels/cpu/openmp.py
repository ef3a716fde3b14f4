"""How long an OpenMP thread spins at the end of a parallel region before it sleeps.

torch's forwards and our C kernels (native.py) share torch's libgomp. A thread that has
finished its share of a region spins, waiting for the others, for `GOMP_SPINCOUNT`
iterations (300,000 by default: milliseconds) before it sleeps. When another process
keeps a core busy, the thread that shares that core is descheduled in the middle of a
region. The thread that finished then spins on the other core, so the descheduled one
cannot run there either, until the busy process's time slice ends. A short spin makes
the finished thread sleep instead, and the OS runs the descheduled thread on the core
it gives up.

So the spin is short: beside a busy process the default spin costs most of the speed
and a short one keeps it, while quiet the two run alike
(docs/performance.md#measurements-behind-the-design). The thread governor (threads.py)
still moves to one thread under steady load, where the spin does not matter; the short
spin is for the time before it does: the first second of a burst of load, and a
calibration or an answer that load catches mid-step.

libgomp reads these variables once, when torch loads it, so `apply_defaults` runs when
`specdec_core` is imported, before anything in it imports torch. A process that
imported torch first keeps libgomp's defaults. A value the user set wins, and so does
`OMP_WAIT_POLICY` (which sets the spin itself when `GOMP_SPINCOUNT` is unset).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "3000"


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set a short OpenMP spin unless the user chose a spin or wait policy."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
