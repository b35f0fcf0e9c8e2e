"""indextts-prepare: from audio and transcripts to the manifests and feature files indextts-train reads.

    indextts-prepare --input data/list.jsonl --model-dir checkpoints --out data/prepared      # IndexTTS2
    indextts-prepare --input data/list.jsonl --model-dir checkpoints25 --out data/prepared25  # IndexTTS-2.5
    indextts-prepare --demo [--family indextts25]     # stand-in models on synthesised audio, then a few steps

Run the same command again after any interruption: it continues (store.py). Several GPUs or machines:
`--shard I/N` per process (or torchrun, one process per GPU); the last to finish writes the manifests
(merge.py). docs/data_preparation.md is the user's guide.

Exit status: 0 every line kept; 3 the manifests were written and some lines were skipped (each in
OUT/skipped.txt; under torchrun 0, the summary says it); 2 bad flags, an unreadable input or config, or an --out
holding another preparation (nothing is written); 5 out of memory with a single clip; 130 interrupted.
"""
from __future__ import annotations

import sys

from trainers.console_streams import quiet_broken_pipes
from trainers.errors import EXIT_OUT_OF_MEMORY, EXIT_USAGE, UserError


@quiet_broken_pipes()
def main(argv: list[str] | None = None) -> int:
    from trainers.tools.prepare.settings import parse_settings

    try:
        settings = parse_settings(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    from trainers.hardware.oom_recovery import OutOfMemoryStop

    try:
        if settings.demo:
            from trainers.tools.prepare.demo import run_demo

            return run_demo(settings)
        from trainers.tools.prepare.run import prepare

        return prepare(settings)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except OutOfMemoryStop as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    except KeyboardInterrupt:
        print("interrupted: run the same command again to continue where it stopped", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":  # torchrun ... -m trainers.tools.prepare.cli
    sys.exit(main())
