#!/usr/bin/env python3
"""How long does a checkpoint save block the training loop: synchronous vs background?

    python benchmarks/save_stall.py [--scale 1.0] [--repeats 3] [--work-dir DIR] [--device cpu|cuda]
                                    [--copy-carried] [--no-reserve] [--smoke]

The default (full size, 3 rounds) took about 2.5-3.5 minutes on a shared 2-core VM and needs
about 17 GB of free disk and 15 GB of free memory.

What it does:

1. Builds, in memory, a checkpoint state of the official model's size without downloading
   anything: random tensors with the shapes of the official IndexTTS2 GPT state dict (group A
   from our UnifiedVoiceGPT built on the meta device with checkpoints/config.yaml: D=1280,
   24 layers, 20 heads, text vocab 12000+1 rows, mel 8194, text pos 602 rows, mel pos 1818
   rows: 527M parameters), plus synthetic "carried" conditioning-encoder tensors bringing the
   model to 866M parameters, plus AdamW exp_avg / exp_avg_sq (and step) for the 527M trained
   parameters, RNG states, config dicts and a metrics list: about 7.7 GB in float32.
   --scale S multiplies the first dimension of every tensor by S (same tensor count).
2. Refuses (exit 2) unless the work directory's disk has room for two checkpoints (the new
   file is complete before rotation deletes the old one) plus 10%, and the machine has
   memory for the state plus its snapshot plus 10% and 1 GB (plus the files when the work
   directory is a RAM filesystem such as /dev/shm).
3. For --repeats rounds, alternately:
     sync        CheckpointWriter(background=False).submit(state, step): the loop is
                 blocked for the whole CheckpointManager.save (serialise, fsync, rename,
                 link, rotate);
     background  CheckpointWriter().submit(state, step): the loop is blocked for the
                 snapshot copy (plus any wait for the previous write, which is zero here
                 because each round waits for the write to finish, as a run whose save
                 interval is longer than one write would). The carried tensors are passed
                 as `static` (not copied), as the trainer would pass run.carried;
                 --copy-carried copies them too. Before the rounds, CheckpointWriter.reserve
                 allocates the snapshot buffers in the background (its time is printed, not
                 counted: in a run it overlaps training); --no-reserve leaves that allocation
                 to the first timed save. While the write runs, the main thread does
                 stand-in training work (a 512x512 matmul loop) and its rate is compared
                 with its rate in the 2 s before: the write's CPU use slows a CPU-bound
                 loop, which the blocked time alone does not show.
   Both modes write into the same run directory with keep=1, through the same manager code.
4. Prints every figure, the medians over the rounds, the machine, the load average
   (`uptime`) before and after, and whether the target is met: median background blocked
   time <= 10% of the median synchronous save. Exit 0 when met, 1 when not, 2 when the
   benchmark could not run. Everything it wrote is deleted at the end.

--smoke (for tests/test_benchmarks.py): one round at 1/1000 of the size with a 0.2 s idle-rate probe, the
target not judged: it checks that the script runs, in seconds.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from trainers.checkpoint.step_files import CheckpointManager  # noqa: E402
from trainers.checkpoint.writer import CheckpointWriter  # noqa: E402
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT  # noqa: E402
from trainers.model.weights import CARRIED_PREFIXES  # noqa: E402

TARGET_FRACTION = 0.10
OFFICIAL_TOTAL_PARAMS = 866_000_000  # official gpt.pth, group A + group B
CARRIED_CHUNK = (1280, 4096)  # synthetic shape for the carried tensors (their real shapes do not matter here)
PROBE_S = 2.0  # seconds of stand-in training work to measure its idle rate
SMOKE_SCALE, SMOKE_PROBE_S = 0.001, 0.2


class BenchError(RuntimeError):
    pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the official size [1.0: about 7.7 GB]")
    p.add_argument("--repeats", type=int, default=3, help="rounds of (sync save, background save) [3]")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="directory on the disk to measure; a fresh subdirectory is used and deleted [system temp]")
    p.add_argument("--copy-carried", action="store_true",
                   help="snapshot the carried tensors too instead of passing them as static (the trainer passes "
                        "run.carried, which training never changes)")
    p.add_argument("--no-reserve", action="store_true",
                   help="do not call CheckpointWriter.reserve first: the first background save then allocates "
                        "its snapshot buffers inside the timed call")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the training state lives [cuda when available]")
    p.add_argument("--smoke", action="store_true", help=f"one round at --scale {SMOKE_SCALE}, the target not judged: "
                   "checks the script runs, measures nothing")
    args = p.parse_args()
    args.probe_s = SMOKE_PROBE_S if args.smoke else PROBE_S
    if args.smoke:
        args.scale, args.repeats = SMOKE_SCALE, 1
    if not 0 < args.scale <= 1 or args.repeats < 1:
        p.error("--scale must be in (0, 1] and --repeats at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    return args


# -- the state -------------------------------------------------------------------


def official_shapes() -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
    """(trained, carried) names and shapes at full size."""
    cfg_path = REPO_ROOT / "checkpoints" / "config.yaml"
    cfg = GPTConfig.from_yaml_section(yaml.safe_load(cfg_path.read_text())["gpt"])
    with torch.device("meta"):
        model = UnifiedVoiceGPT(cfg)
    trained = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    n_trained = sum(_numel(s) for _, s in trained)
    carried: list[tuple[str, tuple[int, ...]]] = []
    left = OFFICIAL_TOTAL_PARAMS - n_trained
    i = 0
    while left > 0:
        rows = min(CARRIED_CHUNK[0], -(-left // CARRIED_CHUNK[1]))
        prefix = CARRIED_PREFIXES[i % len(CARRIED_PREFIXES)]
        carried.append((f"{prefix}synthetic.{i}.weight", (rows, CARRIED_CHUNK[1])))
        left -= rows * CARRIED_CHUNK[1]
        i += 1
    return trained, carried


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def scaled(shape: tuple[int, ...], scale: float) -> tuple[int, ...]:
    return (max(1, round(shape[0] * scale)),) + shape[1:]


def state_bytes(trained, carried, scale: float) -> int:
    params = sum(_numel(scaled(s, scale)) for _, s in trained + carried)
    moments = 2 * sum(_numel(scaled(s, scale)) for _, s in trained)
    return 4 * (params + moments)


class Filler:
    """Fills tensors from a random pool: random bytes at memory speed (content does not
    affect the write; nothing compresses)."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.randn(16 * 2**20, generator=torch.Generator().manual_seed(0)).to(device)

    def tensor(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        t = torch.empty(shape, device=device)
        flat, n, pos = t.view(-1), t.numel(), 0
        while pos < n:
            k = min(n - pos, self.pool.numel())
            flat[pos:pos + k].copy_(self.pool[:k])
            pos += k
        return t


def build_state(scale: float, device: torch.device) -> tuple[dict, int, int, list[torch.Tensor]]:
    """A checkpoint state shaped like train_gpt_v2.save() makes, its tensor byte count and
    tensor count, and the carried tensors (never changed by training)."""
    trained, carried = official_shapes()
    fill = Filler(device)
    params = {name: fill.tensor(scaled(shape, scale), device) for name, shape in trained}
    model_state = dict(params)
    carried_state = {name: fill.tensor(scaled(shape, scale), torch.device("cpu")) for name, shape in carried}
    model_state.update(carried_state)  # the trainer keeps them on the CPU
    opt_state = {
        i: {"step": torch.tensor(1000.0), "exp_avg": fill.tensor(p.shape, device),
            "exp_avg_sq": fill.tensor(p.shape, device).abs_()}
        for i, p in enumerate(params.values())
    }
    state = {
        "format": 2,
        "model": model_state,
        "optimizer": {"state": opt_state, "param_groups": [{
            "lr": 2e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
            "params": list(range(len(params)))}]},
        "optimizer_params": [[n, list(p.shape)] for n, p in params.items()],
        "scheduler": {"last_step": 1000},
        "step": 1000,
        "rng": {"torch": torch.get_rng_state(), "cuda": [], "python": [3, list(range(625)), None]},
        "config": {"effective_batch": 32, "learning_rate": 2e-5, "save_interval": 1000},
        "metrics": [{"step": s, "mel_loss": 1.0 / s, "text_loss": 2.0 / s} for s in range(1, 1001)],
    }
    n_tensor_bytes = sum(t.numel() * t.element_size() for t in model_state.values())
    n_tensor_bytes += sum(t.numel() * t.element_size() for s in opt_state.values() for t in s.values())
    return state, n_tensor_bytes, len(model_state) + 3 * len(opt_state), list(carried_state.values())


# -- measuring -------------------------------------------------------------------


class StandInTraining:
    """Main-thread work standing in for training steps, to see what a background write costs it."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(512, 512, generator=g)
        self.b = torch.randn(512, 512, generator=g)

    def step(self) -> None:
        self.a = torch.tanh(self.a @ self.b) * 0.5

    def rate(self, seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
        return n / (time.perf_counter() - t0)


def sync_round(writer: CheckpointWriter, state: dict, step: int) -> float:
    t0 = time.perf_counter()
    writer.submit(state, step)
    return time.perf_counter() - t0


def background_round(writer: CheckpointWriter, state: dict, step: int, work: StandInTraining) -> dict:
    t0 = time.perf_counter()
    writer.submit(state, step)
    blocked = time.perf_counter() - t0
    n, t1 = 0, time.perf_counter()
    while writer.busy:
        work.step()
        n += 1
    t_end = time.perf_counter()
    writer.wait()  # raises a background error here
    return {"blocked": blocked, "snapshot": writer.last_snapshot_s, "wait": writer.last_wait_s,
            "write": t_end - t0, "work_rate": n / max(t_end - t1, 1e-9)}


def load_average() -> str:
    try:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average: unknown"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def mount_of(path: Path) -> tuple[str, str, str]:
    """(device, filesystem type, mount point) holding ``path``."""
    best = ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) >= len(best[2]):
                best = (dev, fstype, mnt)
    except OSError:
        pass
    return best


def filesystem_of(path: Path) -> str:
    dev, fstype, mnt = mount_of(path)
    return f"{dev} ({fstype}) mounted at {mnt or '?'}"

def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_room(base: Path, nbytes: int, host_copies: int, what: str) -> None:
    """Refuse before building anything: disk for two checkpoints (rotation deletes the old file only
    after the new one is complete) plus 10%; host memory for `host_copies` copies of the state
    (`what` names them) plus 10% and 1 GB, plus the files themselves when the work dir is in RAM."""
    disk_need = int(2 * nbytes * 1.1)
    free = shutil.disk_usage(base).free
    if free < disk_need:
        raise BenchError(f"not enough disk space in {base}: {free / 1e9:.1f} GB free, {disk_need / 1e9:.1f} GB "
                         f"needed (two checkpoints of {nbytes / 1e9:.1f} GB + 10%); pass a smaller --scale or "
                         f"another --work-dir")
    in_ram = mount_of(base)[1] in RAM_FILESYSTEMS
    mem_need = int(host_copies * nbytes * 1.1 + (disk_need if in_ram else 0) + 2**30)
    avail = mem_available()
    if avail is not None and avail < mem_need:
        raise BenchError(f"not enough memory: {avail / 1e9:.1f} GB available, {mem_need / 1e9:.1f} GB needed "
                         f"({what}{', and the files: ' + str(base) + ' is in RAM' if in_ram else ''}); "
                         f"pass a smaller --scale or another --work-dir")


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    base = (args.work_dir or Path(tempfile.gettempdir())).resolve()
    if not base.is_dir():
        raise BenchError(f"--work-dir {base} is not an existing directory")
    trained, carried = official_shapes()
    expected = state_bytes(trained, carried, args.scale)
    # On a GPU the state lives on the device: the host holds only the snapshot.
    check_room(base, expected, 2 if args.device == "cpu" else 1, "state and its snapshot")
    print(f"machine: {machine()}")
    print(f"disk: {base} on {filesystem_of(base)}, {shutil.disk_usage(base).free / 1e9:.1f} GB free")
    print(f"start: {time.strftime('%H:%M:%S')} {load_average()}")

    t0 = time.perf_counter()
    state, nbytes, ntensors, carried = build_state(args.scale, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"state: scale {args.scale:g}, {ntensors} tensors, {nbytes / 1e9:.2f} GB of tensor data on {device} "
          f"(built in {time.perf_counter() - t0:.1f} s); carried tensors "
          f"{'copied at each snapshot' if args.copy_carried else 'passed as static (not copied)'}")

    work_dir = Path(tempfile.mkdtemp(prefix="save_stall_", dir=base))
    print(f"writing into {work_dir} (deleted at the end; delete it by hand if this process is killed)", flush=True)
    try:
        mgr = CheckpointManager(work_dir, keep=1)
        sync_writer = CheckpointWriter(mgr, background=False)
        bg_writer = CheckpointWriter(mgr, static=[] if args.copy_carried else carried)
        work = StandInTraining()
        reserve_s = None
        if not args.no_reserve:
            t1 = time.perf_counter()
            bg_writer.reserve(state)  # as the trainer would after its first step
            bg_writer.wait()
            reserve_s = time.perf_counter() - t1
            print(f"reserve: snapshot buffers allocated in the background in {reserve_s:.1f} s (not counted as "
                  f"blocked: in a run it overlaps the steps before the first save)", flush=True)
        sync_s, bg = [], []
        step = 1000
        for r in range(args.repeats):
            step += 1
            sync_s.append(sync_round(sync_writer, state, step))
            step += 1
            idle_rate = work.rate(args.probe_s)  # just before, as other load on the machine drifts
            bg.append(background_round(bg_writer, state, step, work))
            bg[-1]["speed"] = bg[-1]["work_rate"] / idle_rate
            bg[-1]["lost"] = (1 - bg[-1]["speed"]) * (bg[-1]["write"] - bg[-1]["blocked"])
            print(f"round {r + 1}: sync save {sync_s[-1]:.2f} s blocked | background: blocked "
                  f"{bg[-1]['blocked']:.3f} s (snapshot {bg[-1]['snapshot']:.3f} s, wait {bg[-1]['wait']:.3f} s), "
                  f"write finished {bg[-1]['write']:.2f} s after submit", flush=True)
        file_size = mgr.latest_path().stat().st_size
        snapshot_bytes = bg_writer.buffer_bytes
        sync_writer.close()
        bg_writer.close()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    end_load = load_average()

    med_sync = statistics.median(sync_s)
    blocked = [b["blocked"] for b in bg]
    med_bg = statistics.median(blocked)
    med_write = statistics.median(b["write"] for b in bg)
    speeds = [b["speed"] for b in bg]
    lost = [b["lost"] for b in bg]
    fraction = med_bg / med_sync
    met = fraction <= TARGET_FRACTION
    print()
    print(f"checkpoint file: {file_size / 1e9:.2f} GB; snapshot buffers held: {snapshot_bytes / 1e9:.2f} GB of host "
          f"memory")
    print(f"how: {args.repeats} rounds of (synchronous save, background save) of the same state into one run "
          f"directory (keep=1), timed with time.perf_counter around CheckpointWriter.submit; medians over the rounds")
    print(f"synchronous save, loop blocked (s): {fmt(sync_s)}; median {med_sync:.2f}")
    print(f"background save, loop blocked (s): {fmt(blocked)}; median {med_bg:.3f} "
          + ("(round 1 allocates the snapshot buffers, later rounds reuse them)" if args.no_reserve
             else "(buffers reserved beforehand)"))
    print(f"background write duration (s): {fmt([b['write'] for b in bg])}; median {med_write:.2f}: the loop is "
          f"blocked only for the snapshot while the save interval is longer than this")
    print(f"stand-in training work (CPU matmuls in the main thread) during the background write, as a fraction of "
          f"its speed in the {args.probe_s:g} s before: {', '.join(f'{100 * x:.0f}%' for x in speeds)}; that is "
          f"{fmt(lost)} s of its work lost per save (median {statistics.median(lost):.2f} s). On a GPU the loop "
          f"needs far less CPU; on a busy small CPU machine this can outweigh the blocked time saved")
    print(f"end: {time.strftime('%H:%M:%S')} {end_load}")
    verdict = "not judged (--smoke)" if args.smoke else "MET" if met else "NOT MET"
    print(f"blocked time: background {med_bg:.3f} s = {100 * fraction:.1f}% of synchronous {med_sync:.2f} s; "
          f"target <= {100 * TARGET_FRACTION:.0f}%: {verdict}")
    return 0 if met or args.smoke else 1


def main() -> int:
    args = parse_args()
    try:
        return run(args)
    except BenchError as exc:
        print(f"save_stall: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
