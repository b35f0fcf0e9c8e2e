#!/usr/bin/env python3
"""Fine-tune the IndexTTS2 GPT ("UnifiedVoice" v2) with exact, interruption-proof resume.

    python trainers/train_gpt_v2.py --demo
    python trainers/train_gpt_v2.py --train-manifest train.jsonl --val-manifest val.jsonl \
        --tokenizer checkpoints/bpe.model --config checkpoints/config.yaml \
        --base-checkpoint checkpoints/gpt.pth --output-dir runs/my_voice
    python trainers/train_gpt_v2.py --resume auto --output-dir runs/my_voice

The same command is installed as `indextts-train` (pip install -e . in the repository, which this
script needs too); the code is in the trainers package (trainers/cli.py, trainers/main.py).

Exit statuses: the table of README.md's "Stopping and exit status" (the values: trainers/errors.py).
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import trainers
    from trainers.cli import train_command
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install it with "
          f"`pip install -e {HERE.parent}` (the README's set-up command), then run this again; nothing was trained",
          file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    if Path(trainers.__file__).resolve().parent != HERE:  # e.g. `pip install .` of another copy: its code runs
        print(f"warning: {Path(__file__).name} runs the trainers package installed at "
              f"{Path(trainers.__file__).parent}, not the code beside it in {HERE}; to run this copy, install it "
              f"with `pip install -e {HERE.parent}`", file=sys.stderr)
    train_command()
