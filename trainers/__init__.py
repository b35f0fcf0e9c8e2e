"""Fine-tuning of the IndexTTS2 GPT ("UnifiedVoice" v2): the library behind `indextts-train`, the
tools (trainers.tools) and the Python API (trainers.experiment). Its layers, bottom to top, and the
rule that each imports only downward: tests/test_layers.py."""
import time

# The trainer's start-up is timed from here ("first optimizer step finished X s after process
# start"): a script's first import of the package, before the flags are parsed and torch imported.
PROCESS_START = time.monotonic()
