"""Trainer processes at the official width: the trainer at the config under test with its micro-batch probed
(the answer, the steps after it without an out-of-memory error, the loop's own rate), and, at 4 of its layers,
a real out-of-memory error recovered by halving against an uninterrupted run at the halved size, and that run
in bf16 against the same steps in fp32.

On the CPU side of a dry run the same runs use the config at width 64 and short samples, with out-of-memory
errors injected (trainers/faults.py) so that the probe and the halving run there.

Checkpoints: a run writes its final one (the trainer's product), but the probed run, ended after its last step
(TRAINER_END); the runs that validate also a best.pth at step 0 (the trainer keeps the best of every validation;
at step 0 it holds the weights alone); the probed run has no validation set. Each is deleted once read.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import sys
from pathlib import Path

import torch

from benchmarks.acceptance.context import Context, Finished
from benchmarks.acceptance.corpus import IDX2, LABELS, LONG_CODES, LONG_TEXT, Corpus, build_model, family_of, \
    read_gpt, write_config, write_corpus
from benchmarks.acceptance.flops import flops_per_sample, mfu, peak_flops
from benchmarks.acceptance.runner import Outcome
from benchmarks.throughput import INTERVAL_LINE
from trainers.checkpoint import schema
from trainers.config.flags import parse_command_line
from trainers.hardware.batch_probe import CACHE_NAME, _forward_backward
from trainers.hardware.detect import detect_hardware
from trainers.hardware.oom_recovery import release_memory
from trainers.hardware.precision import choose_amp
from trainers.model.demo_base import ensure_demo_base
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT

EFFECTIVE_BATCH = 64  # the probe tries micro-batches up to the effective batch
TRAINER_STEPS = 4  # the probed run: the loop's rate over steps 2-4 (step 1 holds AdamW's first update)
# ... then SIGKILLed after its last step (trainers/faults.py): its final save (6.3 GB at the official size,
# checksummed) proves nothing here that the other runs' saves do not, and would take seconds of the GPU's time.
TRAINER_END = f"step:{TRAINER_STEPS}"
FLAGS = ["--warmup-steps", "2", "--log-interval", "1", "--save-interval", "1000", "--keep-checkpoints", "1"]
VALIDATION = ["--max-val-batches", "1", "--val-batch-size", "4"]
# Dry run: the config at this width, short samples, and every pass above 2 samples "out of memory".
SMALL = {"model_dim": 64, "heads": 4, "layers": 2}
SMALL_LENGTHS = {"text_len": 20, "code_len": 100, "samples": 16, "val_samples": 4}
SMALL_BATCH, INJECTED_LIMIT = 8, 2
OOM_LAYERS = 4  # the forced out-of-memory run: the official width with 4 layers (see oom_and_precision)
CHANGED = ("model_dim", "heads", "layers")  # of the config under test, in the runs of oom_and_precision
OOM_STEPS = 6
OOM_MICRO_BATCHES = (32, 16, 8)  # the first whose calibration fits and leaves OOM_MARGIN
OOM_MARGIN = 2 ** 29  # 0.5 GiB each side of the cap: the allocator's rounding, cuBLAS's workspace, fragments
CAPPED = Path(__file__).resolve().parent / "capped_trainer.py"
SHM_FOR_WORKERS = 2 ** 31  # /dev/shm below this: one data-loader worker (see _loader)
HALVED = re.compile(r"out of memory at step 1 with micro-batch (\d+): redone with micro-batch (\d+) x accumulation "
                    r"\d+\n\S+ \S+ WARNING cause: (.*)")  # two lines of the trainer's log
FIRST_STEP = re.compile(r"first optimizer step finished ([\d.]+) s after process start")
# The halved run and the run at the halved size from the start compute the same micro-batches; without
# --deterministic some backward kernels add in another order, which Adam turns into weight differences of a
# fraction of the learning rate. Their losses at every step agree within 1e-3 (a dropped or doubled
# micro-batch moves a step's loss and every later one far more).
HALVED_LOSS_RTOL = 1e-3
# bf16 keeps 8 significant bits in the products; after the same steps the validation losses of bf16 and fp32
# (TF32 off) agree within 1%.
PRECISION_RTOL = 1e-2


def _small(ctx: Context) -> bool:
    return ctx.device == "cpu"


def _loader(ctx: Context) -> list[str]:
    """Data-loader workers pass batches through /dev/shm: a container's is often 64 MB, which the prefetched
    batches of the official width (6 MB each, 2 per worker, 4 workers by default) would fill. One worker there."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    return [] if _small(ctx) or free >= SHM_FOR_WORKERS else ["--num-workers", "1"]


def _threads(ctx: Context) -> dict[str, str]:
    """Trainer processes at the official size initialise 0.5 billion weights on the CPU: more than the tests'
    one thread, on a GPU machine."""
    return {} if _small(ctx) else {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}


def official_corpus(ctx: Context, family: str = IDX2) -> Corpus:
    def make() -> Corpus:
        small = _small(ctx)
        return write_corpus(ctx.folder(f"official_{family}"), ctx.demo_tokenizer() if family == IDX2 else None,
                            SMALL if small else None,
                            **(SMALL_LENGTHS if small else {"text_len": LONG_TEXT, "code_len": LONG_CODES}),
                            source=ctx.config(family))
    return ctx.shared(f"official_corpus/{family}/{ctx.device}", make)


def _final(out: Path) -> schema.Checkpoint:
    """The run's final checkpoint, its tensors mapped (large at the official width; the trainer verified it)."""
    return schema.read(out / "latest.pth", mmap=True)


def _drop_checkpoints(*runs: Path) -> None:
    for run in runs:
        for checkpoint in run.glob("*.pth"):
            checkpoint.unlink()


def _expect(done: Finished, what: str, steps: int) -> None:
    if done.returncode != 0 or f"training finished at step {steps} " not in done.stderr:
        raise RuntimeError(f"{what} exited {done.returncode}: {done.tail(800)}")


# -- the trainer at the official config, micro-batch probed ----------------------------------------------------


def _intervals(log: str, batch: int, after: int = 1) -> tuple[float, int]:
    """Samples/s over the logged one-step intervals after the first `after`, from the trainer's own rate per
    interval (benchmarks/throughput.py reads it the same way)."""
    seconds, samples = 0.0, 0
    for match in INTERVAL_LINE.finditer(log):
        end, rate = int(match.group(1)), float(match.group(2))
        if end > after:
            seconds += batch / rate
            samples += batch
    if not samples:
        raise RuntimeError("no timed interval in the run's log")
    return samples / seconds, samples


def probed_run(ctx: Context) -> tuple[Path, Finished, int | None]:
    out = ctx.folder("official_trainer")
    corpus = official_corpus(ctx)
    batch = SMALL_BATCH if _small(ctx) else EFFECTIVE_BATCH
    env = {"INDEXTTS_TRAIN_OOM_ABOVE": str(INJECTED_LIMIT)} if _small(ctx) else _threads(ctx)
    done = ctx.run_one(ctx.trainer(out, *corpus.flags(validation=False), *FLAGS, *_loader(ctx), "--device",
                                   ctx.device, "--effective-batch", str(batch), "--max-steps", str(TRAINER_STEPS),
                                   env=env, kill_at=TRAINER_END))
    cache = out / CACHE_NAME
    micro = json.loads(cache.read_text())["micro_batch"] if cache.exists() else None
    _drop_checkpoints(out)
    return out, done, micro


def _trainer_figures(ctx: Context, done: Finished, micro: int | None) -> tuple[bool, dict]:
    corpus = official_corpus(ctx)
    finished = re.search(rf"^.* step {TRAINER_STEPS}/{TRAINER_STEPS} ", done.stderr, re.MULTILINE) is not None
    oom = "out of memory" in done.stderr.lower()
    first = FIRST_STEP.search(done.stderr)
    figures = {"micro_batch": micro, "exit": done.returncode, "out_of_memory": oom, "seconds": done.seconds,
               "first_step_after_start_s": float(first.group(1)) if first else None}
    ok = done.returncode == -signal.SIGKILL and finished and not oom and bool(micro)
    if ok:
        rate, samples = _intervals(done.stderr, SMALL_BATCH if _small(ctx) else EFFECTIVE_BATCH)
        cfg = ctx.gpt(**(SMALL if _small(ctx) else {}))
        sample_flops = flops_per_sample(cfg, corpus.text_len, corpus.code_len, corpus.positions)
        peak = None if _small(ctx) else peak_flops(ctx.gpu_name or "")
        figures.update(samples_timed=samples, samples_per_s=round(rate, 2),
                       positions_per_s=round(rate * corpus.positions),
                       tokens_per_s=round(rate * (corpus.text_len + corpus.code_len)),
                       mfu=round(mfu(rate, sample_flops, peak[0]), 4) if peak else None)
    else:
        figures["log"] = done.tail(600)
    return ok, figures


def _trainer_lines(figures: dict, layers: int) -> tuple[str, ...]:
    if "samples_per_s" not in figures:
        return ()
    mfu_text = f", MFU {figures['mfu']:.1%}" if figures["mfu"] is not None else ""
    return (f"2.0: the trainer, {layers} layers, micro-batch probed: {figures['micro_batch']}; first step "
            f"{figures['first_step_after_start_s']} s after process start; {figures['seconds']} s in all (ended after "
            f"step {TRAINER_STEPS}, before its final save)",
            f"loop rate over steps 2-{TRAINER_STEPS}: {figures['samples_per_s']} samples/s, "
            f"{figures['positions_per_s']:,} positions/s, {figures['tokens_per_s']:,} text+code tokens/s{mfu_text}")


def official_trainer(ctx: Context) -> Outcome:
    """The trainer at the config under test, effective batch 64 of long samples, micro-batch probed: the probe
    answers and the steps after it run without an out-of-memory error (the run is ended after its last step, see
    TRAINER_END); the loop's rate."""
    _, done, micro = probed_run(ctx)
    ok, figures = _trainer_figures(ctx, done, micro)
    return Outcome(ok, figures, "" if ok else "the probed run did not finish cleanly",
                   _trainer_lines(figures, ctx.gpt().layers))


def official_trainer_cpu_side(ctx: Context) -> Outcome:
    """The same run at width 64 with passes above 2 samples failing: the probe runs on the CPU and answers 2."""
    _, done, micro = probed_run(ctx)
    ok, figures = _trainer_figures(ctx, done, micro)
    return Outcome(ok and micro == INJECTED_LIMIT, figures, "", _trainer_lines(figures, SMALL["layers"]))


# -- a real out-of-memory error, and bf16 against fp32 ---------------------------------------------------------


def _run_flags(ctx: Context, config: Path, base: Path, micro: int) -> list[str]:
    """The flags every run of this check shares but the micro-batch (and precision): one base checkpoint (the
    loading of a gpt.pth at the official width, and the same start for every run) and one validation set (its
    best.pth at step 0 holds the weights alone: 0.5 GB at 4 layers for 2.0, 1.0 GB for 2.5)."""
    family = family_of(read_gpt(config)).name
    return [*official_corpus(ctx, family).flags(), "--config", str(config), "--base-checkpoint", str(base), *FLAGS,
            *VALIDATION, *_loader(ctx), "--device", ctx.device, "--max-steps", str(OOM_STEPS), "--effective-batch",
            str(2 * micro), "--log-sample-ids"]


def _oom_inputs(ctx: Context, cfg: GPTConfig) -> tuple[Path, Path]:
    """The config with OOM_LAYERS layers and a base checkpoint of it (the trainer's initialisation, seed 0; 2.0's
    with the tensors a base carries, 2.5's with its model's alone)."""
    family = family_of(cfg)
    folder = ctx.folder(f"oom_{family.name}")
    config = write_config(folder / "config.yaml", ctx.config(family.name), **{f: getattr(cfg, f) for f in CHANGED})
    extras = {} if family.name == IDX2 else {"extras": lambda width: {}}
    return config, ensure_demo_base(folder, cfg, model=family.model, **extras)


def _train_losses(state: schema.Checkpoint) -> list[tuple[int, float, float]]:
    return [(h["step"], h["text_loss"], h["mel_loss"]) for h in state.history if h["kind"] == "train"]


def _last_validation(state: schema.Checkpoint) -> dict:
    return [h for h in state.history if h["kind"] == "val"][-1]


def _halving(done: Finished, micro: int, injected: bool) -> tuple[bool, dict]:
    found = HALVED.search(done.stderr)
    figures = {"exit": done.returncode, "halved": [int(found.group(1)), int(found.group(2))] if found else None,
               "error": found.group(3)[:160] if found else None}
    real = bool(found) and ("injected" in found.group(3)) == injected and "out of memory" in found.group(3).lower()
    ok = done.returncode == 0 and real and figures["halved"] == [micro, micro // 2]
    return ok and f"training finished at step {OOM_STEPS} " in done.stderr, figures


def _same_ending(halved: Path, reference: Path) -> tuple[bool, dict]:
    """The halved run against the run at the halved size from the start: same samples, losses within rounding."""
    a, b = _final(halved), _final(reference)
    losses_a, losses_b = _train_losses(a), _train_losses(b)
    rel = max((abs(x - y) / abs(y) for (sa, *la), (sb, *lb) in zip(losses_a, losses_b) for x, y in zip(la, lb)),
              default=float("inf"))
    differing = sum(not torch.equal(a.model[k], b.model[k]) for k in a.model)
    largest = max(((a.model[k].double() - b.model[k].double()).abs().max().item() for k in a.model), default=0.0)
    same_samples = (halved / "sample_ids.tsv").read_text() == (reference / "sample_ids.tsv").read_text()
    figures = {"steps": [a.step, b.step], "same_samples": same_samples, "train_loss_rel_diff": rel,
               "weights_differing": differing, "max_abs_weight_diff": largest}
    ok = a.step == b.step == OOM_STEPS and same_samples and len(losses_a) == len(losses_b) == OOM_STEPS
    return ok and rel <= HALVED_LOSS_RTOL, figures


def _precision(bf16: Path, fp32: Path) -> tuple[bool, dict]:
    a, b = _final(bf16), _final(fp32)
    va, vb = _last_validation(a), _last_validation(b)
    rel = max(abs(va[k] - vb[k]) / abs(vb[k]) for k in ("text_loss", "mel_loss"))
    figures = {"steps": [a.step, b.step], "amp": [a.amp_dtype, b.amp_dtype],
               "bf16_val": {k: round(va[k], 5) for k in ("text_loss", "mel_loss")},
               "fp32_val": {k: round(vb[k], 5) for k in ("text_loss", "mel_loss")}, "val_loss_rel_diff": rel}
    return a.step == b.step == OOM_STEPS and rel <= PRECISION_RTOL, figures


def oom_and_precision(ctx: Context, family: str = IDX2) -> Outcome:
    """A real CUDA out-of-memory error: the allocator is capped (torch.cuda.set_per_process_memory_fraction)
    between what a step at micro-batch m needs and what one at m / 2 needs, measured here first with the
    probe's own measurement; the trainer, given --batch-size m, must halve and finish, ending as a run given
    --batch-size m / 2 from the start ends. That run (the default precision, bf16) against the same run in fp32
    with TF32 off: validation losses after the same steps. The three run at once.

    The official width with OOM_LAYERS layers: activations then dominate the weights, so the gap between m
    and m / 2 is wide against the allocator's rounding. A step's two accumulating passes peak at P(m); from the
    first update on, AdamW's moments (2 x the trained weights, M) are held too. The cap is the weights plus the
    midpoint of P(m) (step 1 at m, no moments yet: must not fit) and M + P(m / 2) (every later step: must fit),
    so both miss it by the same margin, at least OOM_MARGIN. IndexTTS-2.5's (oom_and_precision_25) the same."""
    cfg = ctx.gpt(family, layers=OOM_LAYERS)
    micro, fraction, calibration = _calibrate(cfg)
    if micro is None:
        return Outcome(False, calibration, f"no micro-batch in {OOM_MICRO_BATCHES} leaves {OOM_MARGIN / 2 ** 30} GiB "
                                           "each side of the cap on this GPU")
    config, base = _oom_inputs(ctx, cfg)
    runs = {name: ctx.folder(f"oom_{family}/{name}") for name in ("capped", "bf16", "fp32")}
    env = _threads(ctx)
    try:
        capped, bf16, fp32 = ctx.run(
            ctx.trainer(runs["capped"], *_run_flags(ctx, config, base, micro), "--batch-size", str(micro),
                        launcher=[sys.executable, str(CAPPED), f"{fraction:.6f}"], env=env),
            ctx.trainer(runs["bf16"], *_run_flags(ctx, config, base, micro), "--batch-size", str(micro // 2), env=env),
            ctx.trainer(runs["fp32"], *_run_flags(ctx, config, base, micro), "--batch-size", str(micro // 2),
                        "--amp", "off", "--no-tf32", env=env))
        for done, what in ((bf16, "the run at the halved size"), (fp32, "the fp32 run")):
            _expect(done, what, OOM_STEPS)
        halved_ok, halving = _halving(capped, micro, injected=False)
        same_ok, same = _same_ending(runs["capped"], runs["bf16"]) if halved_ok else (False, {"log": capped.tail(800)})
        precision_ok, precision = _precision(runs["bf16"], runs["fp32"])
    finally:
        _drop_checkpoints(*runs.values())
    figures = {"calibration": calibration, "halving": halving, "halved_vs_uninterrupted": same,
               "bf16_vs_fp32": precision}
    return Outcome(halved_ok and same_ok and precision_ok, figures, "" if halved_ok else "no real halving",
                   _oom_lines(figures, micro, LABELS[family]))


def _oom_lines(figures: dict, micro: int, label: str) -> tuple[str, ...]:
    lines = []
    c, h, s, p = (figures.get(k, {}) for k in ("calibration", "halving", "halved_vs_uninterrupted", "bf16_vs_fp32"))
    if "cap_gib" in c:
        lines.append(f"{c['layers']} layers: step peaks {c['step_peak_gib']} GiB at micro-batch {micro} and "
                     f"{micro // 2}; allocator capped at {c['cap_gib']} GiB ({c['margin_gib']} GiB each side)")
    if h.get("halved"):
        lines.append(f"real out-of-memory at micro-batch {h['halved'][0]}, halved to {h['halved'][1]}: {h['error']}")
    if "train_loss_rel_diff" in s:
        lines.append(f"halved vs micro-batch {micro // 2} from the start, {OOM_STEPS} steps: same samples "
                     f"{s['same_samples']}, train losses within {s['train_loss_rel_diff']:.2e} "
                     f"(limit {HALVED_LOSS_RTOL}), {s['weights_differing']} weight tensors not bit-identical "
                     f"(max {s['max_abs_weight_diff']:.2e})")
    if "val_loss_rel_diff" in p:
        lines.append(f"bf16 vs fp32 (TF32 off) after {OOM_STEPS} steps: validation {p['bf16_val']} vs {p['fp32_val']}, "
                     f"relative difference {p['val_loss_rel_diff']:.2e} (limit {PRECISION_RTOL})")
    return tuple(f"{label}: {line}" for line in lines)


def oom_and_precision_cpu_side(ctx: Context, family: str = IDX2) -> Outcome:
    """The capped launcher uncapped on the CPU, the error injected at the first micro-batch of step 1, against the
    run at the halved size (bit-identical here: the CPU adds in one order). The fp32 run's command line parses;
    it does not run (bf16 on the CPU is not what a GPU runs, and 80x slower without bf16 instructions)."""
    config, base = _oom_inputs(ctx, ctx.gpt(family, **{**SMALL, "layers": OOM_LAYERS}))
    micro = SMALL_BATCH // 2
    runs = {name: ctx.folder(f"oom_{family}/{name}") for name in ("capped", "reference")}
    try:
        capped, reference = ctx.run(
            ctx.trainer(runs["capped"], *_run_flags(ctx, config, base, micro), "--batch-size", str(micro),
                        launcher=[sys.executable, str(CAPPED), "0"], env={"INDEXTTS_TRAIN_OOM_AT": "1:0"}),
            ctx.trainer(runs["reference"], *_run_flags(ctx, config, base, micro), "--batch-size", str(micro // 2)))
        _expect(reference, "the run at the halved size", OOM_STEPS)
        halved_ok, halving = _halving(capped, micro, injected=True)
        same_ok, same = (_same_ending(runs["capped"], runs["reference"]) if halved_ok
                         else (False, {"log": capped.tail(800)}))
        precision_ok, precision = _precision(runs["reference"], runs["reference"])  # the comparison's code, no figure
    finally:
        _drop_checkpoints(*runs.values())
    parse_command_line(["--output-dir", str(ctx.work), *_run_flags(ctx, config, base, micro), "--amp", "off",
                        "--no-tf32"])
    figures = {"halving": halving, "halved_vs_uninterrupted": same}
    ok = halved_ok and same_ok and same.get("weights_differing") == 0 and precision_ok
    return Outcome(ok, figures, "", _oom_lines(figures, micro, LABELS[family]))


def _calibrate(cfg) -> tuple[int | None, float, dict]:
    """(micro-batch m, allocator fraction, figures) for the first m of OOM_MICRO_BATCHES that fits with a margin."""
    device = torch.device("cuda", 0)
    amp = choose_amp(detect_hardware(device), "auto").dtype
    total = torch.cuda.get_device_properties(device).total_memory
    model = build_model(cfg, device)
    weights = sum(p.numel() * 4 for p in model.parameters())
    figures: dict = {"layers": cfg.layers}
    try:
        for micro in OOM_MICRO_BATCHES:
            try:
                full, half = (_step_peak(model, n, device, amp) for n in (micro, micro // 2))
            except torch.OutOfMemoryError:
                continue
            later = 2 * weights + half  # AdamW's moments and a step at m / 2
            cap = weights + (full + later) // 2
            margin = (full - later) // 2
            figures.update(micro_batch=micro, step_peak_gib=[round(full / 2 ** 30, 2), round(half / 2 ** 30, 2)],
                           cap_gib=round(cap / 2 ** 30, 2), margin_gib=round(margin / 2 ** 30, 2))
            if margin >= OOM_MARGIN:
                return micro, cap / total, figures
    finally:
        del model
        release_memory(device)
    return None, 0.0, figures


def _step_peak(model: UnifiedVoiceGPT, n: int, device: torch.device, amp: torch.dtype | None, passes: int = 2) -> int:
    """Peak bytes of `passes` accumulating passes over n long samples (a step's two by default), gradients included:
    the probe's own measurement, from a model without gradients and an emptied cache."""
    model.zero_grad(set_to_none=True)
    release_memory(device)
    try:
        return _forward_backward(model, n, device, amp, LONG_TEXT, LONG_CODES, passes=passes)
    finally:
        model.zero_grad(set_to_none=True)
