"""Checks of whole trainer runs on the demos: a kill and resume in the default precision (IndexTTS2's demo, and
IndexTTS-2.5's with --deterministic and --dropout-masks v3: its data path, .npz pairs with their languages, and the
fused masks on CUDA), a CUDA-trained checkpoint resumed on the CPU, and with 2+ GPUs torchrun against one process
and a SIGTERM to one rank."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import NamedTuple

from benchmarks.acceptance.context import Context, Finished
from benchmarks.acceptance.corpus import IDX2, IDX25, LABELS
from benchmarks.acceptance.runner import Outcome
from tests.demo_runs import assert_close_weights, final_state
from trainers.config.flags import parse_command_line

STEPS = 12
FLAGS = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", str(STEPS), "--save-interval", "4",
         "--val-interval", "0", "--max-val-batches", "1", "--dropout", "0.1", "--log-interval", "4",
         "--log-sample-ids", "--keep-checkpoints", "10"]
KILL = "micro:7:1"  # SIGKILL mid-accumulation of step 7; the newest checkpoint is step 4's
BRANCH_STEP = 8  # the CUDA run's checkpoint of this step is resumed on the CPU
BRANCH_FROM = f"model_step{BRANCH_STEP}.pth"
# Without --deterministic a GPU resume agrees with the uninterrupted run within float rounding, which Adam
# and bf16 turn into small weight differences: the validation losses at the end must agree to 1%.
RESUME_LOSS_RTOL = 1e-2
# A CUDA run's last steps trained on the CPU instead (fp32 there, the run's precision on the GPU): 2%.
CPU_BRANCH_LOSS_RTOL = 2e-2
DDP_FLAGS = ["--effective-batch", "16", "--batch-size", "8", "--max-steps", str(STEPS), "--save-interval", "4",
             "--val-interval", "0", "--max-val-batches", "1", "--log-sample-ids", "--dropout", "0.1",
             "--keep-checkpoints", "10", "--log-interval", "4", "--warmup-steps", "4", "--deterministic"]
RANK_SIGTERM = "rank1/SIGTERM@micro:7:0"  # SIGTERM to rank 1 alone while it computes step 7


def _expect(done: Finished, status: int, what: str) -> None:
    if done.returncode != status:
        raise RuntimeError(f"{what} exited {done.returncode}, expected {status}: {done.tail()}")


class Kind(NamedTuple):
    family: str
    deterministic: bool
    masks: str = "v2"  # --dropout-masks


def _kind_name(kind: Kind) -> str:
    masks = f" --dropout-masks {kind.masks}" if kind.masks != "v2" else ""
    return f"{LABELS[kind.family]} {'--deterministic' if kind.deterministic else 'default'}{masks}"


def demo_pairs(ctx: Context, *kinds: Kind) -> dict[Kind, tuple[Path, Path]]:
    """For each kind (a family's demo, --deterministic or not): an uninterrupted run and one SIGKILLed at KILL then
    resumed, in the default precision on ctx.device: {kind: (reference, resumed)}. Every pair not run yet in this
    invocation starts at once (a run's start-up dominates on a GPU machine), then every resume at once."""
    key = lambda kind: f"demo_pair/{ctx.device}/{kind.family}/{kind.deterministic}/{kind.masks}"  # noqa: E731
    todo = [k for k in dict.fromkeys(kinds) if key(k) not in ctx.memo]
    if todo:
        pairs, jobs = {}, []
        for kind in todo:
            name = (f"demo_{kind.family}_{ctx.device}_{'deterministic' if kind.deterministic else 'default'}_"
                    f"{kind.masks}")
            ref, run = ctx.folder(f"{name}/reference"), ctx.folder(f"{name}/resumed")
            flags = [*ctx.demo(kind.family), *FLAGS, "--device", ctx.device, "--dropout-masks", kind.masks,
                     *(["--deterministic"] if kind.deterministic else [])]
            pairs[kind] = (ref, run)
            jobs += [ctx.trainer(ref, *flags), ctx.trainer(run, *flags, kill_at=KILL)]
        finished = ctx.run(*jobs)
        for i, kind in enumerate(todo):
            _expect(finished[2 * i], 0, f"the uninterrupted run ({_kind_name(kind)})")
            _expect(finished[2 * i + 1], -signal.SIGKILL, f"the run killed at {KILL} ({_kind_name(kind)})")
        resumed = ctx.run(*[ctx.trainer(pairs[k][1], "--resume", "auto") for k in todo])
        for kind, done in zip(todo, resumed):
            _expect(done, 0, f"the resume ({_kind_name(kind)})")
        for kind in todo:
            ctx.memo[key(kind)] = pairs[kind]
    return {k: ctx.memo[key(k)] for k in kinds}


def demo_pair(ctx: Context, deterministic: bool, family: str = IDX2) -> tuple[Path, Path]:
    return demo_pairs(ctx, Kind(family, deterministic))[Kind(family, deterministic)]


def difference(a: Path, b: Path) -> dict:
    """How far the final checkpoints of two runs are apart: the largest absolute difference of a weight and
    of an optimizer value, the tensors not bit-identical, and whether each step had the same samples."""
    sa, sb = final_state(a), final_state(b)
    pairs = [("weight", sa.model[k], sb.model[k]) for k in sa.model]
    pairs += [("optimizer", x, sb.optimizer["state"][i][name])
              for i, state in sa.optimizer["state"].items() for name, x in state.items()]
    largest = {"weight": 0.0, "optimizer": 0.0}
    for kind, x, y in pairs:
        largest[kind] = max(largest[kind], (x.double() - y.double()).abs().max().item())
    return {"steps": [sa.step, sb.step], "max_abs_weight": largest["weight"],
            "max_abs_optimizer": largest["optimizer"], "tensors_differing": sum(not x.equal(y) for _, x, y in pairs),
            "same_samples": (a / "sample_ids.tsv").read_text() == (b / "sample_ids.tsv").read_text(),
            "amp": sa.amp_dtype}


def last_validation(run: Path) -> dict[str, float]:
    return [h for h in final_state(run).history if h["kind"] == "val"][-1]


def _relative(a: dict, b: dict, keys: tuple[str, ...] = ("text_loss", "mel_loss")) -> float:
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in keys)


# The pairs of demo_resume: 2.0's with and without --deterministic (the default one feeds cuda_checkpoint_on_cpu),
# 2.5's with: what 2.5 adds is its model and data path, the checkpoint and resume machinery being shared. 2.5's
# trains with the fused masks (v3, compiled on CUDA): the masks do not depend on the family, 2.0's pairs keep the
# default's (v2), and a fourth pair would cost the run's time.
DEMO_KINDS: tuple[Kind, ...] = (Kind(IDX2, True), Kind(IDX2, False), Kind(IDX25, True, "v3"))


def _exact(ctx: Context, pair: tuple[Path, Path], kind: Kind) -> tuple[bool, dict, str]:
    """A --deterministic pair: bit-identical after the SIGKILL and resume."""
    exact = difference(*pair)
    ok = exact["tensors_differing"] == 0 and exact["same_samples"] and exact["steps"] == [STEPS, STEPS]
    amp = exact["amp"] if exact["amp"] not in (None, "None") else "fp32"  # the checkpoint writes "None" for none
    line = (f"{_kind_name(kind)}, {amp} on {ctx.device}: SIGKILL mid-step 7, resumed to step "
            f"{exact['steps'][1]}: {exact['tensors_differing']} tensors differ from the uninterrupted run (weights "
            f"and AdamW state), same samples {exact['same_samples']}")
    return ok, exact, line


def _resumes(ctx: Context, kinds: tuple[Kind, ...]) -> Outcome:
    """Every kind's pair (run at once): --deterministic ones bit-identical, default ones within rounding."""
    pairs = demo_pairs(ctx, *kinds)
    ok, figures, lines = True, {}, []
    for kind in kinds:
        if kind.deterministic:
            passed, figures[_kind_name(kind)], line = _exact(ctx, pairs[kind], kind)
        else:
            ref, run = pairs[kind]
            default = figures[_kind_name(kind)] = difference(ref, run)
            default["val_loss_rel_diff"] = _relative(last_validation(run), last_validation(ref))
            passed = default["same_samples"] and default["val_loss_rel_diff"] <= RESUME_LOSS_RTOL
            line = (f"{_kind_name(kind)}: {default['tensors_differing']} tensors differ (max weight "
                    f"{default['max_abs_weight']:.2e}), validation losses within {default['val_loss_rel_diff']:.2e} "
                    f"(limit {RESUME_LOSS_RTOL})")
        ok &= passed
        lines.append(line)
    return Outcome(ok, figures, "", tuple(lines))


def demo_resume(ctx: Context) -> Outcome:
    """SIGKILL and resume in the default precision: bit-identical with --deterministic, else within rounding."""
    return _resumes(ctx, DEMO_KINDS)


def demo_resume_cpu_side(ctx: Context) -> Outcome:
    """The --deterministic pairs on the CPU: bit-identical."""
    return _resumes(ctx, tuple(kind for kind in DEMO_KINDS if kind.deterministic))


def _branch_on_cpu(ctx: Context, source: Path) -> tuple[Finished, Path]:
    out = ctx.folder(f"{source.parent.name}_branch_on_cpu")
    done = ctx.run_one(ctx.trainer(out, "--resume", str(source / BRANCH_FROM), "--device", "cpu"))
    _expect(done, 0, f"the resume of {BRANCH_FROM} on the CPU")
    return done, out


def _compare_branch(source: Path, branch: Path, done: Finished) -> tuple[bool, dict]:
    ids = {line.split("\t")[0]: line for line in (source / "sample_ids.tsv").read_text().splitlines()}
    branched = (branch / "sample_ids.tsv").read_text().splitlines()
    figures = {"steps": final_state(branch).step, "amp_on_gpu": final_state(source).amp_dtype,
               "amp_on_cpu": final_state(branch).amp_dtype,
               "same_samples": {int(line.split("\t")[0]) for line in branched} >= set(range(BRANCH_STEP + 1, STEPS + 1))
               and all(ids.get(line.split("\t")[0]) == line for line in branched),
               "val_loss_rel_diff": _relative(last_validation(branch), last_validation(source)),
               "hardware_change_logged": "hardware changed" in done.stderr}
    ok = figures["steps"] == STEPS and figures["same_samples"] and figures["val_loss_rel_diff"] <= CPU_BRANCH_LOSS_RTOL
    return ok, figures


def cuda_to_cpu(ctx: Context) -> Outcome:
    """The default-precision CUDA run's checkpoint of BRANCH_STEP trained on to STEPS on the CPU."""
    source, _ = demo_pair(ctx, deterministic=False)
    done, branch = _branch_on_cpu(ctx, source)
    ok, figures = _compare_branch(source, branch, done)
    ok &= figures["hardware_change_logged"]
    return Outcome(ok, figures, f"same samples, validation losses within {CPU_BRANCH_LOSS_RTOL} of the CUDA run")


def cuda_to_cpu_cpu_side(ctx: Context) -> Outcome:
    """The same branch from the CPU's --deterministic reference (a CPU-to-CPU resume)."""
    source, _ = demo_pair(ctx, deterministic=True)
    done, branch = _branch_on_cpu(ctx, source)
    ok, figures = _compare_branch(source, branch, done)
    return Outcome(ok, figures)


def two_processes(ctx: Context) -> tuple[Path, Path, Finished]:
    """One process and torchrun with 2, --deterministic, the same effective batch: (single, two, two's log)."""
    def make() -> tuple[Path, Path, Finished]:
        single, two = ctx.folder("ddp/single"), ctx.folder("ddp/two")
        one, both = ctx.run(ctx.trainer(single, *ctx.demo(), *DDP_FLAGS), ctx.torchrun(2, two, *ctx.demo(), *DDP_FLAGS))
        _expect(one, 0, "the single-process run")
        _expect(both, 0, "the 2-process run")
        return single, two, both
    return ctx.shared("two_processes", make)


def torchrun_vs_single(ctx: Context) -> Outcome:
    single, two, log = two_processes(ctx)
    figures = difference(single, two)
    try:
        assert_close_weights(single, two)  # the tests' tolerance for another split of the same steps
        close = True
    except AssertionError:
        close = False
    figures["nccl"] = "cuda:nccl" in log.stderr
    ok = close and figures["same_samples"] and figures["nccl"]
    return Outcome(ok, figures, "same samples; weights within tests/demo_runs.py assert_close_weights")


def torchrun_sigterm(ctx: Context) -> Outcome:
    """SIGTERM to rank 1 alone: both save at the step boundary and exit 143; the resume over NCCL ends
    bit-identical to the uninterrupted 2-process run (--deterministic)."""
    _, two, _ = two_processes(ctx)
    out = ctx.folder("ddp/sigterm")
    flags = [*ctx.demo(), *DDP_FLAGS]
    stopped = ctx.run_one(ctx.torchrun(2, out, *flags, kill_at=RANK_SIGTERM))
    stopped_at = final_state(out).step
    resumed = ctx.run_one(ctx.torchrun(2, out, "--resume", "auto"))
    _expect(resumed, 0, "the 2-process resume")
    figures = {"stopped_at": stopped_at, "stop_logged": "stopped by signal at step 7" in stopped.stderr,
               **difference(two, out)}
    ok = stopped_at == 7 and figures["stop_logged"] and figures["tensors_differing"] == 0 and figures["same_samples"]
    return Outcome(ok, figures)


def torchrun_cpu_side(ctx: Context) -> Outcome:
    """The torchrun checks' command lines parse with the trainer's own parser (tests/test_ddp_runs.py runs
    torchrun on the CPU with gloo)."""
    for args in ([*ctx.demo(), *DDP_FLAGS], ["--resume", "auto"]):
        try:
            parse_command_line(["--output-dir", str(ctx.work), *args])
        except SystemExit as exc:
            return Outcome(False, {}, f"the trainer refuses {args}: exit {exc.code}")
    return Outcome(True, {})
