"""Generation at validation (--sample-interval): the chosen validation samples' mel codes, generated with the
KV cache (trainers/model/generation.py), their gen/* metrics, and their set on disk.

Which samples: trainers/data/generation_samples.py, keyed by the run's seed, so every validation, resume
and machine generates the same ones. Each sample may generate up to LIMIT_FACTOR x its reference length
+ LIMIT_SLACK codes (within the model's position table); one that has not emitted the stop code by then
counts as not stopped. The limit is the sample's own, so its codes do not depend on its batch-mates.

Greedy by default. With --sample-temperature each sample draws from its own torch.Generator, keyed by the
run's seed and the sample's place in the set, and started afresh at every validation: a sample's draws do
not depend on its batch-mates, the batch size or the number of processes, and two validations' sets differ
only by what the model learned between them (the same draws meet different probabilities).

Nothing here touches training's random state: greedy choice draws nothing, sampling reads only its own
generators, the model's training flag is restored, and the validation loader reads files in a fixed order.
Under torchrun each process generates every N-th sample of the set; the codes are combined in every
process (World.combine_parts), so all compute the same gen/* metrics and decide the best checkpoint and
early stopping alike; rank 0 writes the set.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainers.data.data_order import StepPlan
from trainers.data.generation_samples import GenerationSamples, generation_samples
from trainers.data.sample_table import SampleTable
from trainers.hardware.determinism import nondeterministic_or
from trainers.hardware.oom_recovery import halved, is_out_of_memory, oom_message, release_memory
from trainers.model.code_choice import Sampling
from trainers.model.generation import generate_codes
from trainers.run.sample_sets import SampleStore, new_set
from trainers.training.generation_metrics import generation_metrics
from trainers.training.validation_listeners import Validation, ValidationListener

log = logging.getLogger("train")

LIMIT_FACTOR = 2  # a sample twice its reference length is babbling: enough to tell, bounded in cost
LIMIT_SLACK = 10
KEEP_SETS = 5  # the newest sets kept under RUN_DIR/samples, besides the best checkpoint's


@dataclass
class ValidationGeneration(ValidationListener):
    """The run's generation at validation, a validation listener."""

    interval: int
    chosen: GenerationSamples
    ref_lengths: list[int]
    store: SampleStore | None  # rank 0's; None in the other processes of a torchrun job
    highest: int  # the most codes the model's mel position table allows
    sampling: Sampling | None  # None: greedy
    seed: int
    model: Any  # the run's UnifiedVoiceGPT
    loader: Any  # the validation's StepLoader
    hardware: Any  # the run's HardwarePlan: its device and validation batch
    world: Any  # the run's World (trainers/training/distributed.py)
    batch: int = 0  # samples per generation batch once out of memory halved it (0: the validation batch)
    pending: tuple[list[torch.Tensor], list[bool], dict[str, float]] | None = None  # rank 0: until written

    @classmethod
    def for_run(cls, s: Any, run_dir: Path, loader: Any, model: Any, hardware: Any,
                world: Any) -> "ValidationGeneration | None":
        """For the run's settings `s`; None when --sample-interval is 0 or there is no validation set."""
        interval = s.sample_interval
        if not interval or loader is None:
            if world.is_main and not interval and s.sample_temperature:
                log.warning("--sample-temperature %g has no effect: generation at validation is off;",
                            s.sample_temperature)
                log.warning("pass --sample-interval N to generate samples")
            elif world.is_main and interval:
                log.warning("--sample-interval %d has no effect without a validation set: pass --val-manifest FILE "
                            "to generate samples", interval)
            return None
        table = SampleTable.of(loader.dataset.samples)
        chosen = generation_samples(table, s.seed)
        if chosen.left_out:
            log.warning("generation at validation: languages %s get no sample (the set holds at most %d); their "
                        "gen/* metrics are missing. Use fewer validation languages to hear them all",
                        ", ".join(str(lang) for lang in chosen.left_out), len(chosen.indices))
        store = SampleStore(run_dir, KEEP_SETS) if world.is_main else None
        if store is not None:
            store.clean_temporaries()
        sampling = Sampling(s.sample_temperature, s.sample_top_k, s.sample_top_p) if s.sample_temperature else None
        return cls(interval, chosen, [int(table.code_len[i]) for i in chosen.indices], store,
                   model.cfg.max_mel_tokens + 2, sampling, s.seed, model, loader, hardware, world)

    def validated(self, v: Validation) -> None:
        """At the validations due: the chosen samples' codes, their gen/* metrics reported and added to `v`."""
        if not self.due(v.step, v.final):
            return
        t0, faults = time.perf_counter(), v.faults
        codes, stopped = self.generate(v.step, lambda size: faults.at("generation-batch", v.step, size=size),
                                       lambda j: faults.at("generate", v.step, j))
        metrics = generation_metrics(codes, stopped, self.ref_lengths, self.chosen.languages)  # alike in every process
        if self.store is not None:
            self.pending = (codes, stopped, metrics)
        v.log.report(v.step, metrics, generation_lines(v.step, metrics, time.perf_counter() - t0), fields=metrics)
        v.means.update(metrics)

    def due(self, step: int, final: bool) -> bool:
        """Samples at validations of steps divisible by the interval (step 0 included) and at the end."""
        return final or step % self.interval == 0

    def generate(self, step: int, before_batch: Callable[[int], None],
                 after_batch: Callable[[int], None]) -> tuple[list[torch.Tensor], list[bool]]:
        """Each chosen sample's codes (cut at its limit) and whether it stopped within it, in chosen order.
        This process generates its own samples (all of them without torchrun), in batches of the validation's
        size; out of memory halves the batch for the samples left and for later validations (the codes do not
        depend on the batch). The loop's fault points: `before_batch(size)` before each batch, `after_batch(j)`
        after the j-th."""
        device, val_batch = self.hardware.device, self.hardware.val_batch
        table = torch.zeros(len(self.chosen.indices), 2 + self.highest, dtype=torch.int64)
        left = self.world.own_items(range(len(self.chosen.indices)))
        done_batches = 0
        while left:
            size = min(self.batch or val_batch, val_batch)
            chunks = [left[i: i + size] for i in range(0, len(left), size)]
            rows = [[self.chosen.indices[p] for p in chunk] for chunk in chunks]
            try:
                for chunk, batch in zip(chunks, self.loader.batches([StepPlan(0, 0, rows)])):
                    before_batch(len(chunk))
                    self._generate_batch(batch.to(device), chunk, table, device)
                    left = left[len(chunk):]
                    after_batch(done_batches)
                    done_batches += 1
                break
            except RuntimeError as exc:
                if not is_out_of_memory(exc):  # --deterministic's stop names this pass, as validation's does
                    raise nondeterministic_or(exc, f"in the generation at validation of step {step}")
                error = oom_message(exc)
            release_memory(device)  # outside the except block, whose traceback holds the failed batch
            self.batch = halved(size, "generation at validation", error)
            log.warning("out of memory while generating samples at step %d: batches of %d from here on", step,
                        self.batch)
            log.warning("cause: %s", error)
            log.warning("(--val-batch-size sets where generation starts)")
        table = self.world.combine_parts(table, "generation at validation")
        return [row[2: 2 + int(row[0])].clone() for row in table], [bool(row[1]) for row in table]

    def _generate_batch(self, b: Any, chunk: list[int], table: torch.Tensor, device: torch.device) -> None:
        """Generate the samples at positions `chunk` (their batch `b`) into their rows of `table`:
        [length, stopped, codes...]. Sampled, each draws from its own generator, fresh at every validation."""
        limits = [min(self.highest, LIMIT_FACTOR * self.ref_lengths[p] + LIMIT_SLACK) for p in chunk]
        generators = None if self.sampling is None else [
            torch.Generator(device).manual_seed(sample_seed(self.seed, p)) for p in chunk]
        out = generate_codes(self.model, b.text_ids, b.text_lens, max(limits), sampling=self.sampling,
                             generator=generators, **b.conditioning)
        for p, c, s, lim in zip(chunk, out.codes, out.stopped, limits):
            c = c[:lim]
            table[p, :2] = torch.tensor([len(c), int(bool(s) and len(c) < lim)])  # the stop is the lim-th token at most
            table[p, 2: 2 + len(c)] = c

    def settled(self, v: Validation) -> None:
        """Rank 0: the set generated at this validation, atomically, once best.pth is written: the newest
        KEEP_SETS and the best step's are kept."""
        if self.store is None or self.pending is None:
            return
        step, best_step = v.step, (v.best or {}).get("step")
        codes, stopped, metrics = self.pending
        self.pending = None
        settings: dict[str, Any] = {"search": "greedy", "kv_cache": True,
                                    "limit": f"{LIMIT_FACTOR} x reference + {LIMIT_SLACK}", "mel_positions": "upstream"}
        if self.sampling is not None:
            settings.update(search="sampled", temperature=self.sampling.temperature, top_k=self.sampling.top_k,
                            top_p=self.sampling.top_p, generators=f"one per sample, keyed by seed {self.seed}")
        sample_set = new_set(step, self.chosen.ids, self.chosen.languages, codes, stopped, self.ref_lengths,
                             settings, metrics)
        try:
            path = self.store.write(sample_set, protect=[best_step] if best_step is not None else [])
        except OSError as exc:  # a listening aid is not worth a checkpoint: the run saves and trains on
            log.warning("could not write the sample set of step %d, %s:", step, self.store.path_of(step))
            log.warning("  %s", exc)
            log.warning("training goes on and its checkpoints are saved; free disk space or move away what is")
            log.warning("in the set's place to have the next sets written")
            return
        log.info("generation step %d: %d samples written to %s", step, len(codes), path)


def generation_lines(step: int, metrics: dict[str, float], seconds: float) -> list[str]:
    """Two lines, each within 120 characters."""
    return [f"generation step {step} stop_rate {metrics['gen/stop_rate']:.3f} length_ratio_median "
            f"{metrics['gen/length_ratio_median']:.3f} length_error_median {metrics['gen/length_error_median']:.3f}",
            f"generation step {step} longest_run_median {metrics['gen/longest_run_median']:.1f} samples "
            f"{int(metrics['gen/samples'])} seconds {seconds:.2f}"]


def sample_seed(seed: int, position: int) -> int:
    """The seed of the generator of the sample at `position` in the set: 63 bits mixed from both."""
    high, low = np.random.SeedSequence([seed, position]).generate_state(2, np.uint32)
    return (int(high) << 31) ^ int(low)
