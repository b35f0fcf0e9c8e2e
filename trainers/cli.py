"""The trainer's command, `indextts-train` (and `python trainers/train_gpt_v2.py`): flags, then torch.

--help and usage errors answer before torch is imported (seconds on a cold start), a stop signal
during the imports is only noted (trainers/stop_signals.py), and the CUDA allocator's settings are
chosen before torch reads them (trainers/hardware/cuda_alloc.py).
"""
from __future__ import annotations

import os
from typing import NoReturn

from trainers.config.flags import parse_command_line
from trainers.hardware.cuda_alloc import use_expandable_segments
from trainers.stop_signals import EarlySignals


def train_command() -> NoReturn:
    """Parse the command line, train, and end the process with the trainer's exit status."""
    # Until main() installs its handlers, a stop signal is noted and main() ends the start-up quietly.
    early = EarlySignals().install()
    command = parse_command_line()  # --help and usage errors exit here, before torch is imported
    use_expandable_segments(os.environ)  # before torch, whose CUDA allocator reads it
    from trainers.main import main  # imports torch
    from trainers.training.process_exit import exit_process

    exit_process(main(command=command, early=early))
