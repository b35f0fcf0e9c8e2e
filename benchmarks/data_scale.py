#!/usr/bin/env python3
"""What a large manifest costs the trainer: resident memory and time to the first optimizer step.

    python benchmarks/data_scale.py [--sizes 2000,200000,1000000] [--torchrun 2] [--workers 2] [--work-dir DIR]
                                    [--smoke]

What it does:

1. Builds the demo corpus, tokenizer and base checkpoint once and, for each size N, a training
   manifest of N paired lines cycling through the demo's 384 lines with unique ids (the feature
   files are shared; benchmarks/resume_skip_cost.py writes them).
2. For each N, in a fresh run directory: a fresh start (--max-steps 1), then a resume of it
   (--resume auto --max-steps 2). Demo model, effective batch 16, --num-workers 0, one thread.
3. For the largest N only:
   * loader workers: a resume with --num-workers W that runs 40 more steps, watching each worker;
   * torchrun: a fresh start and a resume with P processes (gloo on the CPU), in their own run
     directory, watching every trainer process.
4. In this process, for the largest N: what the validated-manifest cache costs and saves (the content
   fingerprint of the manifest, the full check, a check reused from the cache) and what one stat of a
   feature file costs (over STAT_FILES fresh empty files, warm), the per-file pass a cache keyed on
   the manifests alone would have to repeat on every resume. And what a forked loader worker
   copies: a child process reads every sample once (what an epoch of FeatureDataset.__getitem__
   does, without the file loads) and reports its private memory (USS) before and after.
5. Memory is read from /proc while the trainer runs (every 0.2 s, and once more at the moment its
   "first optimizer step finished" line is read): RSS of the main process at the first step,
   its peak (VmHWM), and for several processes PSS (shared pages divided among the processes
   that map them: what the processes hold together) and USS (pages a process alone holds).
   Time: the trainer's own "first optimizer step finished X s after process start".

Prints a table and "per sample" figures: (RSS at the largest N - RSS at the smallest N) / the
difference in lines. Exits 0 when the targets hold, 1 when one is missed, 2 when a run failed:
  * memory held at the first step, per sample: <= 100 bytes, fresh start and resume;
  * a resume of the largest N reaches its first step at most 2 s later than one of the smallest;
  * under torchrun, the processes' PSS together grow by <= 100 bytes per sample per process.
Timings on a shared machine are noisy; each figure is a single run unless --repeats is given.
--smoke (for tests/test_benchmarks.py) runs every case at 32 and 64 lines, the workers for 2 steps and
200 stat files, and judges no target: it checks that the script runs.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resume_skip_cost import build_assets, write_big_manifest  # noqa: E402

TRAINER = REPO_ROOT / "trainers" / "train_gpt_v2.py"
FIRST_STEP_RE = re.compile(r"first optimizer step finished ([0-9.]+) s after process start")
BYTES_PER_SAMPLE = 100
RESUME_EXTRA_S = 2.0
WORKER_STEPS = 40
STAT_FILES = 20_000
RUN_TIMEOUT_S = 900
POLL_S = 0.2


class BenchError(RuntimeError):
    pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2000,200000,1000000", help="manifest lines, comma separated")
    p.add_argument("--repeats", type=int, default=1, help="runs of each single-process case; medians reported")
    p.add_argument("--workers", type=int, default=2, help="loader workers for the worker case (0: skip it)")
    p.add_argument("--torchrun", type=int, default=2, help="processes for the torchrun case (0: skip it)")
    p.add_argument("--work-dir", type=Path, default=None, help="where to build everything [a fresh temp dir]")
    p.add_argument("--smoke", action="store_true", help="every case at 32 and 64 lines, no target judged: checks the "
                   "script runs")
    args = p.parse_args()
    args.sizes = sorted(int(s) for s in args.sizes.split(","))
    if args.sizes[0] < 32 or args.repeats < 1:
        p.error("every size must be at least 32 lines; --repeats at least 1")
    args.worker_steps, args.stat_files = WORKER_STEPS, STAT_FILES
    if args.smoke:
        args.sizes, args.repeats, args.worker_steps, args.stat_files = [32, 64], 1, 2, 200
    return args


# --- memory -------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def memory(pid: int, trainers_only: bool = True) -> dict[str, int] | None:
    """rss, hwm, pss, uss of one process in bytes (None once it is gone, or not a trainer)."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    values[line[2:5].lower()] = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Private_Clean", "Private_Dirty"):
                    values[key] = int(rest.split()[0]) * 1024
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, ValueError):
        return None
    if trainers_only and b"train_gpt_v2" not in cmdline and b"torch.distributed.run" not in cmdline:
        return None  # not ours (e.g. a shell)
    return {"rss": values.get("rss", 0), "hwm": values.get("hwm", 0), "pss": values.get("Pss", 0),
            "uss": values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)}


@dataclass
class Watch:
    """Polls a process tree; keeps each process's largest figures and a snapshot at the first step."""

    root: int
    peak: dict[int, dict[str, int]] = field(default_factory=dict)
    at_first_step: dict[int, dict[str, int]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> dict[int, dict[str, int]]:
        now = {}
        for pid in descendants(self.root):
            m = memory(pid)
            if m is not None:
                now[pid] = m
                old = self.peak.setdefault(pid, dict(m))
                for k, v in m.items():
                    old[k] = max(old[k], v)
        return now

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.sample()


@dataclass
class Result:
    wall: float
    own: float
    main: dict[str, int]  # the process that printed the first-step line, at that moment (hwm: its peak)
    others: dict[int, dict[str, int]]  # every other trainer process at that moment
    peaks: dict[int, dict[str, int]]


def timed_run(cmd: list[str], env: dict[str, str], label: str, launcher: bool = False) -> Result:
    """Run `cmd` to its end; `launcher`: the process started is torchrun, its children are the trainers."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    watch = Watch(proc.pid)
    poller = threading.Thread(target=watch.run, daemon=True)
    poller.start()
    tail: list[str] = []
    wall = own = None
    try:
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-40:]
            m = FIRST_STEP_RE.search(line)
            if m and wall is None:
                wall, own = time.monotonic() - start, float(m.group(1))
                watch.at_first_step = watch.sample()
            if time.monotonic() - start > RUN_TIMEOUT_S:
                break
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        watch.stop.set()
        poller.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if proc.returncode != 0 or wall is None:
        raise BenchError(f"{label}: exit {proc.returncode}, first step line {'seen' if wall else 'missing'}:\n"
                         + "\n".join(tail))

    def trainer_figures(seen: dict[int, dict[str, int]]) -> tuple[dict[int, dict[str, int]], int | None]:
        trainers = {p: dict(m) for p, m in seen.items() if not (launcher and p == proc.pid)}
        main_pid = (min(trainers) if trainers else None) if launcher else proc.pid  # torchrun: the first rank
        return trainers, main_pid if main_pid in trainers else None

    trainers, main_pid = trainer_figures(watch.at_first_step)
    if main_pid is None:  # on a loaded machine the line was read after the trainers had ended: their peaks
        trainers, main_pid = trainer_figures(watch.peak)
    if main_pid is None:
        raise BenchError(f"{label}: no trainer process was seen while it ran (polled every {POLL_S} s)")
    main = dict(trainers[main_pid], hwm=watch.peak.get(main_pid, trainers[main_pid])["hwm"])
    return Result(wall, own, main, {p: m for p, m in trainers.items() if p != main_pid}, watch.peak)


# --- cases --------------------------------------------------------------------------------------


def env_for(threads: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INDEXTTS_TRAIN_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.3f} GiB"


def describe(label: str, r: Result) -> str:
    extra = ""
    if r.others:
        extra = "; others " + ", ".join(f"pid {p}: rss {gib(m['rss'])} pss {gib(m['pss'])} uss {gib(m['uss'])}"
                                        for p, m in sorted(r.others.items()))
    return (f"{label}: first step {r.own:.2f} s (wall {r.wall:.2f} s); main rss {gib(r.main['rss'])} "
            f"pss {gib(r.main['pss'])} peak {gib(r.main['hwm'])}{extra}")


def median_result(results: list[Result]) -> Result:
    results = sorted(results, key=lambda r: r.own)
    return results[len(results) // 2]


def measure_parts(work: Path, manifest: Path, stat_files: int) -> list[str]:
    from trainers.data.feature_folders import file_state
    from trainers.data.manifest import ManifestSpec, manifests_fingerprint, validate_manifests
    from trainers.data.manifest_cache import read_manifests
    from trainers.data.manifest_lines import DataLimits

    specs, limits = [ManifestSpec(manifest, None)], DataLimits(48, 150)  # checkpoints/demo.yaml's limits
    cache = work / "parts" / "train.samples"
    shutil.rmtree(cache.parent, ignore_errors=True)
    timed = {}
    for name, call in (("fingerprint (sha256 of the manifest bytes)", lambda: manifests_fingerprint(specs)),
                       ("full check (parse, validate, stat each feature file)",
                        lambda: validate_manifests(specs, limits, "--train-manifest")),
                       ("first start: full check and cache written",
                        lambda: read_manifests(specs, limits, "--train-manifest", cache).save()),
                       ("resume: check reused from the cache (fingerprint included)",
                        lambda: read_manifests(specs, limits, "--train-manifest", cache))):
        start = time.perf_counter()
        call()
        timed[name] = time.perf_counter() - start
    folder = work / "stat_files"
    folder.mkdir(exist_ok=True)
    paths = [str(folder / f"{i:06d}_codes.npy") for i in range(stat_files)]
    for p in paths:
        open(p, "ab").close()
    for p in paths:  # warm the inode cache, as on the first start
        file_state(p)
    start = time.perf_counter()
    for p in paths:
        file_state(p)
    per_file = (time.perf_counter() - start) / stat_files
    size = manifest.stat().st_size / 2 ** 20
    out = [worker_copy(specs, limits)] + [f"{manifest.name} ({size:.0f} MiB): " + "; ".join(f"{k} {v:.2f} s" for k, v in timed.items()),
           f"one feature-file stat (lstat + access, warm): {per_file * 1e6:.1f} us, so a million paired samples "
           f"with 3 unique files each would pay {per_file * 3e6:.1f} s per resume for a per-file pass"]
    print("\n".join(out), flush=True)
    return out


def worker_copy(specs: list, limits: object) -> str:
    """Private memory of a forked child before and after it reads every sample once."""
    from trainers.data.manifest import load_manifests

    samples = load_manifests(specs, limits)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a loader worker's view of the samples
        os.close(read)
        before = memory(os.getpid(), trainers_only=False)["uss"]
        for i in range(len(samples)):
            samples[i].codes_path
        after = memory(os.getpid(), trainers_only=False)["uss"]
        os.write(write, f"{before} {after}".encode())
        os._exit(0)
    os.close(write)
    before, after = (int(x) for x in os.read(read, 100).split())
    os.waitpid(pid, 0)
    os.close(read)
    return (f"forked worker reading each of {len(samples):,} samples once: private memory {gib(before)} -> "
            f"{gib(after)} (+{(after - before) / len(samples):.0f} bytes per sample copied from the parent)")


def main() -> int:
    args = parse_args()
    given = args.work_dir is not None
    work = args.work_dir.resolve() if given else Path(tempfile.mkdtemp(prefix="data_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    load_before = os.getloadavg()
    table: dict[tuple[int, str], Result] = {}
    lines_out: list[str] = []
    try:
        assets, base = build_assets(work)
        common = ["--demo", "--val-manifest", str(assets.val_manifest), "--tokenizer", str(assets.tokenizer),
                  "--base-checkpoint", str(base), "--batch-size", "16", "--grad-accumulation", "1",
                  "--val-interval", "0", "--max-val-batches", "1", "--save-interval", "1000000"]
        for n in args.sizes:
            manifest = work / f"train_{n}.jsonl"
            if not manifest.is_file():
                write_big_manifest(assets.train_manifest, manifest, n)
            data = [*common, "--train-manifest", str(manifest)]
            fresh_runs, resume_runs = [], []
            for r in range(args.repeats):
                run_dir = work / "runs" / f"n{n}_{r}"
                shutil.rmtree(run_dir, ignore_errors=True)
                base_cmd = [sys.executable, str(TRAINER), *data, "--output-dir", str(run_dir), "--num-workers", "0"]
                fresh_runs.append(timed_run([*base_cmd, "--max-steps", "1"], env_for(), f"fresh {n}"))
                resume_runs.append(timed_run([*base_cmd, "--resume", "auto", "--max-steps", "2"], env_for(),
                                             f"resume {n}"))
            table[(n, "fresh")], table[(n, "resume")] = median_result(fresh_runs), median_result(resume_runs)
            for kind, runs in (("fresh", fresh_runs), ("resume", resume_runs)):
                each = f" [runs: {', '.join(f'{r.own:.2f} s' for r in runs)}]" if len(runs) > 1 else ""
                lines_out.append(describe(f"{n:>9,} lines {kind:<6}", table[(n, kind)]) + each)
                print(lines_out[-1], flush=True)
        largest = args.sizes[-1]
        data = [*common, "--train-manifest", str(work / f"train_{largest}.jsonl")]
        if args.workers:
            run_dir = work / "runs" / f"n{largest}_0"
            cmd = [sys.executable, str(TRAINER), *data, "--output-dir", str(run_dir), "--resume", "auto",
                   "--num-workers", str(args.workers), "--max-steps", str(2 + args.worker_steps)]
            r = timed_run(cmd, env_for(), "workers")
            table[(largest, "workers")] = r
            workers = {p: m for p, m in r.peaks.items() if p in r.others}
            lines_out.append(describe(f"{largest:>9,} lines resume, {args.workers} loader workers", r))
            lines_out.append(f"  loader workers over {args.worker_steps} steps, largest figures: " + ", ".join(
                f"pid {p}: rss {gib(m['rss'])} uss {gib(m['uss'])}" for p, m in sorted(workers.items())))
            print("\n".join(lines_out[-2:]), flush=True)
        lines_out += measure_parts(work, work / f"train_{largest}.jsonl", args.stat_files)
        if args.torchrun:
            run_dir = work / "runs" / f"n{largest}_ddp"
            shutil.rmtree(run_dir, ignore_errors=True)
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(args.torchrun), str(TRAINER), *data, "--output-dir", str(run_dir), "--num-workers", "0"]
            for kind, extra in (("ddp fresh", ["--max-steps", "1"]), ("ddp resume", ["--resume", "auto",
                                                                                     "--max-steps", "2"])):
                r = timed_run([*launcher, *extra], env_for(), kind, launcher=True)
                table[(largest, kind)] = r
                ranks = [r.main, *r.others.values()]
                total_pss = sum(m["pss"] for m in ranks)
                lines_out.append(f"{largest:>9,} lines {kind}, {args.torchrun} processes: first step {r.own:.2f} s; "
                                 f"trainer processes rss {', '.join(gib(m['rss']) for m in ranks)}; pss together "
                                 f"{gib(total_pss)}")
                print(lines_out[-1], flush=True)
                table[(largest, kind + " pss")] = total_pss  # type: ignore[assignment]
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 2
    finally:
        if not given:
            shutil.rmtree(work, ignore_errors=True)
    return report(args, table, lines_out, t_begin, load_before)


def report(args: argparse.Namespace, table: dict, lines_out: list[str], t_begin: float,
           load_before: tuple[float, float, float]) -> int:
    small, large = args.sizes[0], args.sizes[-1]
    ok = True
    print()
    for line in lines_out:
        print(line)
    if large > small:
        lines = large - small
        for kind in ("fresh", "resume"):
            per = (table[(large, kind)].main["rss"] - table[(small, kind)].main["rss"]) / lines
            ok &= per <= BYTES_PER_SAMPLE
            print(f"{kind}: memory held at the first step grows by {per:.0f} bytes per sample from {small:,} to "
                  f"{large:,} lines (target <= {BYTES_PER_SAMPLE})")
        extra = table[(large, "resume")].own - table[(small, "resume")].own
        ok &= extra <= RESUME_EXTRA_S
        print(f"resume: the first step comes {extra:.2f} s later at {large:,} lines than at {small:,} "
              f"(target <= {RESUME_EXTRA_S:.1f} s)")
        if args.torchrun:
            for kind in ("ddp fresh", "ddp resume"):
                pss = table[(large, kind + " pss")]
                single = table[(small, "resume")].main["pss"]
                per = (pss / args.torchrun - single) / lines
                ok &= per <= BYTES_PER_SAMPLE
                print(f"{kind}: PSS per process, less one process's PSS at {small:,} lines, per sample: {per:.0f} "
                      f"bytes (target <= {BYTES_PER_SAMPLE})")
    print(f"how: demo model, effective batch 16, --num-workers 0 unless stated, OMP_NUM_THREADS=1; fresh and resumed "
          f"runs: the median of {args.repeats} by time to the first step, the other cases one run each; {os.cpu_count()} CPU core(s) {platform.machine()}, python "
          f"{platform.python_version()}; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"(a shared machine: expect noise); benchmark total {time.monotonic() - t_begin:.0f} s")
    if args.smoke:
        print("--smoke: tiny manifests, the targets above are not judged")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
