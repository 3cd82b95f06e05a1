"""Control of the OpenMP runtime (libgomp) that torch and kvshare's C++ kernels share."""
from __future__ import annotations

import ctypes
import os

# OpenMP 5.0's omp_pause_resource_all(omp_pause_soft): ends the calling thread's worker threads.
_OMP_PAUSE_SOFT = 1


def release_openmp_workers() -> bool:
    """End the calling thread's OpenMP worker threads (libgomp's, which torch and these kernels
    share); True if a loaded libgomp did. Call it from a thread that is done computing when
    another thread takes over, as the server's event loop does once the engine thread starts:
    libgomp keeps one team of workers per thread that ever ran a parallel region, and once a
    process holds more workers than CPUs it stops letting idle workers spin between regions,
    so the stepping thread's workers sleep and are woken hundreds of times a step (the bundled
    model decoding in a second thread after the first built it: 12.6 against 8.6 ms/token, its
    worker busy 57% of the time; after this call in the first thread, 8.7 ms at 99%). A team
    the thread needs later is made again, of the size torch set (the pause keeps it). No-op
    (False) where libgomp is not loaded. (GNU libgomp's pause ends the calling thread's workers
    only; LLVM's libomp, shipped under the same name by some distributions, ends every
    thread's.)"""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # only the copy already loaded
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    return pause(_OMP_PAUSE_SOFT) == 0
