"""How the trainer process ends: with its status, and without tearing down a broken process group.

After a peer of a torchrun job is lost, `World.close` leaves the process group as it is (destroying
it, or any collective, would talk to the dead peer). Python's own shutdown would then tear down
gloo's threads and the futures of DDP's communication hook, whose callbacks need the interpreter
being finalised: at times the process dies there of std::terminate ("terminate called without an
active exception", or an uncaught gloo::IoException) with SIGABRT (-6) instead of its documented
status (seen now and then when a worker was SIGKILLed at a random moment of training).
The same abort was seen after a clean stop too (a SIGTERM to one worker, both saved and returned
143, one then died of "terminate called without an active exception" after destroy_process_group):
a torchrun worker's shutdown is not safe either way. Everything the user needs is closed before
this point (the checkpoint writer, TensorBoard, the log files, the run directory's lock, the data
workers), so every torchrun worker skips that shutdown.

Once the status is decided, a stop signal must not change it: a second Ctrl-C arriving during Python's
shutdown found the interpreter's signal handlers already reset to the default (CPython restores SIG_DFL for
every signal with a Python handler as it finalises) and killed the process with -2 after it had saved and
said "stopped by signal" (seen in benchmarks/reliability_campaign.py). SIG_IGN is the one setting that
shutdown keeps, so the stop signals are ignored from here on.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

from trainers.stop_signals import ignore_stop_signals


def exit_process(status: int) -> NoReturn:
    """sys.exit(status); os._exit(status), after flushing the log streams, in a torchrun worker (RANK and
    WORLD_SIZE set) or wherever a process group is still initialised (left behind broken)."""
    import torch.distributed as dist

    ignore_stop_signals()
    torchrun_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun_worker or (dist.is_available() and dist.is_initialized()):
        logging.shutdown()  # flushes every handler
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to say there
                stream.flush()
        os._exit(status)
    sys.exit(status)
