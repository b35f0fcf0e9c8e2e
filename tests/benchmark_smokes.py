"""Every benchmark's small mode: its command, the figure lines it must print, and a runner that starts the
scripts as the processes they are, each at most once per test session: in the background from the session's
start (tests/conftest.py), or several at a time when a test asks for one that was not started.

A benchmark's small mode (`--smoke`) runs every part of the script once at tiny sizes and prints its figures
as usual; it judges no timing target (exit 0). tests/test_benchmarks.py runs them all; tests/test_gpu_acceptance.py
reads the same gpu_acceptance run instead of starting a second one.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.acceptance.context import end_tree
from tests.demo_runs import REPO, subprocess_env
from tests.slowness import scaled

BENCHMARKS = REPO / "benchmarks"
TIMEOUT_S = 600  # a whole small mode on an idle machine (scaled: tests/slowness.py); the slowest takes about 40 s
NUM = r"-?\d+(?:\.\d+)?"
NUMS = r"-?\d+\.\d+(?:, -?\d+\.\d+)*"


@dataclass(frozen=True)
class Smoke:
    args: tuple[str, ...]  # after the script; "{out}" is the run's own folder
    figures: tuple[str, ...]  # regular expressions (multiline): the lines the README quotes figures from
    seconds: float  # about this long alone on 2 idle cores (the longest are started first)
    one_thread: bool = True  # OMP_NUM_THREADS=1, as for the trainer processes of the tests (False: as the user has it)


SMOKES: dict[str, Smoke] = {
    "amp_cost.py": Smoke(("--smoke",), (
        rf"^  fp32 +{NUM} s per step \(1\.00x fp32\)  rounds: {NUMS}$",
        rf"^  bf16 +{NUM} s per step \({NUM}x fp32\)",
        rf"^  fp16 +{NUM} s per step \({NUM}x fp32\)",
        rf"^  fp32 determ\. +{NUM} s per step \({NUM}x fp32\)",
        rf"cross-entropy alone, forward \+ backward, \d+ x 8194 logits: fused {NUM} ms, gather {NUM} ms"), 6),
    "dropout_cost.py": Smoke(("--smoke",), (
        rf"^dropout ops alone, .* batch 2 x 394 .*\n  v2 +median +{NUM} ms.*\n  v1 +median +{NUM} ms.*\n"
        rf"  F\.dropout +median +{NUM} ms.*\n  v3 +median +{NUM} ms",
        r"^dropout ops alone, .* batch 8 x 394 ",
        rf"^training step \(forward, backward, AdamW\), batch 8 .*\n.*\n  none +{NUM} .*\n  v2 +{NUM} .* {NUM}%\n"
        rf"  v3 +{NUM} .* {NUM}%",
        rf"^target: v2 adds <= 1\.5x what F\.dropout adds .*ratio {NUM} -> ",
        rf"^target: v2 adds < 3% to a batch-8 training step: {NUM}% -> ",
        rf"^v3 \(CPU: eager, as the trainer runs it here\): adds {NUM}% to the batch-8 step \(v2: {NUM}%\); "
        rf"ops alone at batch 2: v3 {NUM} ms, v2 {NUM} ms"), 6),
    "lora_cost.py": Smoke(("--smoke",), (
        rf"^  full +trainable [\d,]+ \(100\.00% of full\); optimizer state {NUM} GB; checkpoint {NUM} GB$",
        rf"^  LoRA r8 +trainable [\d,]+ \({NUM}% of full\); optimizer state {NUM} GB; checkpoint {NUM} GB$",
        rf"^  full +{NUM} s per step \(1\.00x full\); peak resident {NUM} GB  rounds: {NUMS}$",
        rf"^  LoRA r8 +{NUM} s per step \({NUM}x full\); peak resident {NUM} GB  rounds: {NUMS}$"), 8),
    "family_cost.py": Smoke(("--smoke",), (
        rf"^  2\.0 full +trainable [\d,]+; optimizer state {NUM} GB; checkpoint {NUM} GB$",
        rf"^  2\.5 LoRA r32 +trainable [\d,]+; optimizer state {NUM} GB; checkpoint {NUM} GB$",
        rf"^  2\.5 full +{NUM} s per step \({NUM}x 2\.0 full\); peak resident {NUM} GB  rounds: {NUMS}$",
        rf"^  2\.5 LoRA r32 +{NUM} s per step \({NUM}x 2\.0 full\); peak resident {NUM} GB  rounds: {NUMS}$",
        rf"^  2\.5 at once +60510 columns \(fp32 logits {NUM} GB\): keeps {NUM} GB for backward; peak adds {NUM} GB; "
        rf"{NUM} s$",
        rf"^  2\.5 in blocks +60510 columns \(fp32 logits {NUM} GB\): keeps {NUM} GB for backward; peak adds {NUM} GB; "
        rf"{NUM} s$"), 16),
    "ema.py": Smoke(("--smoke",), (
        r"^\| step \| weights \| EMA [\d.]+ \|$",
        rf"^\| 8 \| {NUM} \| {NUM} \|$",
        r"^the weights' validation is the same in every run: yes$",
        rf"^memory, official config, full fine-tuning: [\d,]+ trained values, the average {NUM} GB fp32",
        rf"^memory, official config, LoRA r8: [\d,]+ trained values, the average {NUM} GB fp32",
        rf"^time, .*, 2 layers \([\d,]+ trained values\): EMA update {NUM} ms, training step {NUM} s: \+{NUM}% per "
        r"step"), 12),
    "generation_cost.py": Smoke(("--smoke",), (
        rf"^demo \(checkpoints/demo\.yaml: width \d+, \d+ layers, \d+ heads\), texts 24-48 ids, \d+ codes each:\n"
        rf"  kv cache  {NUM} s \({NUM} ms per step of the batch; runs {NUMS}\)\n"
        rf"  no cache  {NUM} s \({NUM} ms per step of the batch; runs {NUMS}\)\n  no cache / kv cache = {NUM}x$",
        rf"^official width \(checkpoints/config\.yaml: width \d+, \d+ heads, \d+ of 24 layers\), texts 60-120 ids, "
        rf"\d+ codes each:\n  kv cache  {NUM} s .*\n  no cache  {NUM} s .*\n  no cache / kv cache = {NUM}x$",
        rf"^official width .*, \d+ codes each:\n  kv cache  {NUM} s \({NUM} ms per step of the batch; runs {NUMS}\)\n"
        r"  no cache  not run "), 3),
    "padding.py": Smoke(("--smoke",), (
        rf"^demo: \d+ samples.*\n  micro-batch 4: plain {NUM}   sorted {NUM}   grouped {NUM} .*\n"
        rf"  micro-batch 8: plain {NUM}   sorted {NUM}   grouped {NUM} ",
        rf"^synthetic: \d+ samples.*\n  micro-batch 4: plain {NUM} .*\n  micro-batch 8: plain {NUM} ",
        rf"^  window +16: m4 {NUM}  m8 {NUM} .* tokens/step cv {NUM} .*<- GROUP_WINDOW_STEPS$",
        rf"^  window +1: .* tokens/step cv {NUM} "), 1),
    "save_stall.py": Smoke(("--smoke",), (
        rf"^state: scale {NUM}, \d+ tensors, {NUM} GB of tensor data",
        rf"^checkpoint file: {NUM} GB; snapshot buffers held: {NUM} GB",
        rf"^synchronous save, loop blocked \(s\): {NUMS}; median {NUM}$",
        rf"^background save, loop blocked \(s\): {NUMS}; median {NUM} ",
        rf"^background write duration \(s\): {NUMS}; median {NUM}:",
        r"^stand-in training work .* before: \d+%",
        rf"^blocked time: background {NUM} s = {NUM}% of synchronous {NUM} s"), 4),
    "snapshot_host_memory.py": Smoke(("--smoke",), (
        rf"^computed: \d+ buffers, {NUM} GiB",
        rf"^computed: one pinned buffer per tensor holds {NUM} GiB",
        rf"^computed: packed pinned blocks take {NUM} GiB, pageable {NUM} GiB",
        r"^this machine .*: (pinned|pageable|synchronous) saves for the official model",
        rf"^measured \(--scale {NUM}\): reserved {NUM} GiB for \d+ buffers .* in {NUM} s; resident memory grew "
        rf"{NUM} GiB",
        rf"^measured: snapshot into them in {NUM} s, allocating {NUM} GiB more"), 3),
    "verify_cost.py": Smoke(("--smoke",), (
        rf"^sha256 on one core: {NUM} GB/s",
        rf"^file: {NUM} GB \(\d+ tensors\)",
        rf"^save \(Checkpointer\.save, checksums included\): {NUMS} s; median {NUM} s",
        rf"^checksums at save \(integrity\.compute\): {NUMS} s; median {NUM} s = \d+% of the save",
        rf"^load alone \(torch\.load weights_only\): {NUMS} s; median {NUM} s",
        rf"^load \+ verify \(schema\.read\): {NUMS} s; median {NUM} s",
        rf"^verification adds {NUM} s to a warm-cache load",
        rf"^mapped read \+ verify \(what export does\): {NUMS} s; median {NUM} s; export's verification adds {NUM} s"),
        4),
    "throughput.py": Smoke(("--smoke",), (
        rf"^\| old \| {NUM} \| [\d,]+ \| {NUMS} \|$",
        rf"^\| new \| {NUM} \| [\d,]+ \| {NUMS} \|$",
        rf"^new / old: steps/s x{NUM}, real tokens/s x{NUM}"), 12),
    "resume_skip_cost.py": Smoke(("--smoke",), (
        r"^resume deep: +epoch 1, step \d+ of the epoch, sample offset \d+ \(\d+% of the epoch\)",
        rf"^sample 0: median wall {NUM} s to first optimizer step \(runs: {NUMS}\); trainer-reported {NUM} s",
        rf"^deep    : median wall {NUM} s to first optimizer step \(runs: {NUMS}\); trainer-reported {NUM} s",
        rf"^ratio deep/zero = {NUM} \(target <= 1\.20"), 13),
    "data_scale.py": Smoke(("--smoke",), (
        rf"^ +[\d,]+ lines fresh : first step {NUM} s \(wall {NUM} s\); main rss {NUM} GiB pss {NUM} GiB "
        rf"peak {NUM} GiB",
        rf"^ +[\d,]+ lines resume: first step {NUM} s \(wall {NUM} s\); main rss {NUM} GiB",
        rf"^ +[\d,]+ lines resume, \d+ loader workers: first step {NUM} s",
        rf"^ +[\d,]+ lines ddp fresh, 2 processes: first step {NUM} s; .*; pss together {NUM} GiB",
        rf"^ +[\d,]+ lines ddp resume, 2 processes: first step {NUM} s; .*; pss together {NUM} GiB",
        rf"^forked worker reading each of [\d,]+ samples once: private memory .* \(\+{NUM} bytes per sample",
        rf"fingerprint \(sha256 of the manifest bytes\) {NUM} s; full check .* {NUM} s",
        rf"^fresh: memory held at the first step grows by {NUM} bytes per sample",
        rf"^resume: memory held at the first step grows by {NUM} bytes per sample",
        rf"^resume: the first step comes {NUM} s later",
        rf"^ddp fresh: PSS per process, .* per sample: {NUM} bytes",
        rf"^ddp resume: PSS per process, .* per sample: {NUM} bytes"), 38),
    "forgetting.py": Smoke(("--smoke",), (
        r"^\| replay of base \| seed \| base mel_loss: base model -> step \| rise \(rel\) \| new mel_loss: base model -> "
        r"step \| base first past \+10% \|$",
        rf"^\| 0% \| \d+ \| {NUM} -> {NUM} \(step \d+\) \| [-+]{NUM} \([-+]{NUM}%\) \| {NUM} -> {NUM} \| "
        r"(never|step \d+) \|$",
        rf"^\| 30% \| \d+ \| {NUM} -> {NUM} \(step \d+\) \| [-+]{NUM} \([-+]{NUM}%\) \| {NUM} -> {NUM} \| ",
        rf"^  replay +30%: step \d+ [-+]{NUM}%  step \d+ [-+]{NUM}%$",
        rf"^  replay +10%: base mel_loss rise [-+]{NUM} \([-+]{NUM}%\); new mel_loss {NUM}; base past \+10% in \d+ "
        r"of \d+ runs$"), 12),
    "ddp_scaling.py": Smoke(("--smoke",), (
        rf"^  1 proc x 1 thread +{NUM} steps/s  \(1\.00x 1 proc x 1 thread; runs {NUMS}\)",
        rf"^  2 procs, background +{NUM} steps/s  \({NUM}x 1 proc x 1 thread; runs {NUMS}\)",
        rf"^  loop blocked per checkpoint save, 2 procs, background: {NUM} s \(runs {NUMS}\)"), 14),
    "ddp_peer_loss.py": Smoke(("--smoke",), (
        r"^trial 0: rank 0 SIGKILLed; survivor rank 1 exit -?\d+",
        r"^  \(-?\d+, (True|False)\): \d+ of \d+$"), 11),
    "reliability_campaign.py": Smoke(("--smoke", "--sample-interval", "3"), (
        r"^references +1 +1  bit-identical 1$",
        r"^kills +\d+ +\d+  \d+ SIGKILLs landed of \d+ sent \(\d+ at exact points, \d+ after a delay\); "
        r"resumed bit-identically \d+, differed \d+, failed \d+$",
        r"^signals +\d+ +\d+  stopped mid-run, resumed bit-identically \d+, .* differed \d+, failed \d+$",
        r"^corruptions +\d+ +\d+  damage detected by inspect_checkpoint --verify \d+/\d+; fell back, ended "
        r"bit-identical \d+, refused cleanly \d+, caught by merge/export \d+, harmless \d+, failed \d+$",
        r"^inputs +\d+ +\d+  clear error \d+, clear error after start-up \d+, warned, trained on \d+, traceback \d+, "
        r"accepted silently \d+, other \d+$",
        r"^all +(\d+) +\1$",
        r"^every trial kept its promise$"), 31),
    # Its detailed checks are in tests/test_gpu_acceptance.py, on the same run's JSON report and results folder.
    "gpu_acceptance.py": Smoke(("--smoke", "--out-dir", "{out}"), (
        r"^PASS machine: ",
        r"^SKIP official_step: .*CPU side passed\n  2\.0: fp32, 2 layers at width 64, text head 12,001 wide, .*\n"
        rf"  probe: micro-batch 2 .* in {NUM} s\n  step now: {NUM} s, ",
        rf"^  before/after: AdamW foreach {NUM} s/step -> foreach \(the CPU.s\) {NUM} s/step",
        r"^SKIP official_step_25: .*CPU side passed\n  2\.5: fp32, 2 layers at width 64, text head 60,510 wide, .*\n"
        rf"  probe: micro-batch 2 .* in {NUM} s\n  step now: {NUM} s, ",
        rf"^  dropout masks v2 -> v3: {NUM} -> {NUM} s/step, [\d,]+ -> [\d,]+ tokens/s, MFU \? -> \?, the masks' share "
        rf"of the step {NUM}% -> {NUM}%",
        r"^  2\.5 --deterministic --dropout-masks v3, fp32 on cpu: SIGKILL mid-step 7, resumed to step 12: "
        r"0 tensors differ ",
        r"^SKIP oom_and_precision: .*CPU side passed\n  2\.0: real out-of-memory at micro-batch 4, halved to 2: ",
        r"^SKIP oom_and_precision_25: .*CPU side passed\n  2\.5: real out-of-memory at micro-batch 4, halved to 2: ",
        r"^SKIP background_save: .*CPU side passed\n  2\.0: state .* by a background save .* against .* by a "
        r"synchronous save",
        r"^gpu_acceptance: \d+ passed, 0 failed, \d+ skipped in \d+ s"), 80, one_thread=False),
    "prepare_speed.py": Smoke(("--smoke",), (
        rf"^indextts2, 8 clips of {NUM}-{NUM} s .*\n  features, one clip at a time +{NUM} utt/s  rounds: {NUM}\n"
        rf"  features, batched \(16\) +{NUM} utt/s  rounds: {NUM}; {NUM}x; outputs equal: yes\n"
        rf"  whole command, --batch-size 1 +{NUM} utt/s  rounds: {NUM}\n"
        rf"  whole command, batched +{NUM} utt/s  rounds: {NUM}; {NUM}x; outputs equal: yes$",
        rf"^indextts25, 8 clips of .*\n(.*\n){{3}}  whole command, batched +{NUM} utt/s .*outputs equal: yes$",
        rf"^target: batched features >= 3x one clip at a time, outputs equal: {NUM}x -> not judged"), 4),
    "gpu_table.py": Smoke(("--smoke",), (
        r"^check at width 128, fp32: .*: equal$",
        r"^check at width 128, bf16: .*: equal$",
        rf"^bytes a sample keeps for backward at the official config \(1738 positions\), bf16/fp16: {NUM} GiB",
        r"^\| T4 16 GB \| fp16 \| \d+ \(computed\) \| \d+ \(computed\) \| [\d.]+ GiB \(computed\) \|$",
        r"^\| H100 80 GB \| bf16 \| \d+ \(computed\) \| \d+ \(computed\) \| [\d.]+ GiB \(computed\) \|$"), 12),
}


@dataclass(frozen=True)
class SmokeRun:
    script: str
    returncode: int | None  # None: killed at TIMEOUT_S
    output: str  # stdout and stderr together
    seconds: float
    folder: Path  # the run's own folder (its cwd, "{out}")


_done: dict[str, SmokeRun] = {}  # this test session's runs
_background: threading.Thread | None = None
_stop_background = threading.Event()


def start_in_background(scripts: list[str], folder: Path, at_once: int = 1) -> None:
    """Start these scripts' small modes now, `at_once` at a time, while the rest of the suite runs: most of
    the suite trains in this one process on one thread, so a core is mostly free on a 2-core machine. The
    tests that read them (`run_smokes`) wait for them; tests/conftest.py runs those tests last."""
    global _background
    _background = threading.Thread(target=_run, args=(scripts, folder, at_once, _stop_background), daemon=True,
                                   name="benchmark smokes")
    _background.start()


def stop_background() -> None:
    """Kill what the background runs still have running (the end of the test session)."""
    _stop_background.set()
    if _background is not None:
        _background.join()


def run_smokes(scripts: list[str], folder: Path, at_once: int = 3) -> dict[str, SmokeRun]:
    """Each script's small mode, `at_once` at a time, longest first; a script already run in this session (or
    started in the background) is not run again. Every process tree still running when this returns or raises
    is killed."""
    if _background is not None:
        _background.join()
    _run(scripts, folder, at_once)
    return {s: _done[s] for s in scripts}


def _run(scripts: list[str], folder: Path, at_once: int, stop: threading.Event | None = None) -> None:
    todo = sorted((s for s in dict.fromkeys(scripts) if s in SMOKES and s not in _done), key=lambda s: -SMOKES[s].seconds)
    running: list[tuple[str, subprocess.Popen, Path, float]] = []
    try:
        while (todo or running) and not (stop and stop.is_set()):
            while todo and len(running) < at_once:
                running.append(_start(todo.pop(0), folder))
            time.sleep(0.1)
            for entry in [r for r in running if r[1].poll() is not None or time.monotonic() - r[3] > scaled(TIMEOUT_S)]:
                running.remove(entry)
                _done[entry[0]] = _finish(*entry)
    finally:
        for _, proc, _, _ in running:
            end_tree(proc)


def _start(script: str, folder: Path) -> tuple[str, subprocess.Popen, Path, float]:
    out = folder / script.removesuffix(".py")
    out.mkdir(parents=True, exist_ok=True)
    smoke = SMOKES[script]
    env = subprocess_env()
    if not smoke.one_thread:
        env = {k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    args = [a.replace("{out}", str(out)) for a in smoke.args]
    with open(out / "output.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, str(BENCHMARKS / script), *args], cwd=out, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return script, proc, out, time.monotonic()


def _finish(script: str, proc: subprocess.Popen, out: Path, started: float) -> SmokeRun:
    over_time = proc.poll() is None
    end_tree(proc)  # and whatever it started that is still running
    text = (out / "output.log").read_text(encoding="utf-8", errors="replace")
    return SmokeRun(script, None if over_time else proc.returncode, text, round(time.monotonic() - started, 1), out)
