"""Generation at validation (--sample-interval): the chosen validation samples' mel codes, generated greedily
with the KV cache (trainers/model/generation.py), their gen/* metrics, and their set on disk.

Which samples: trainers/data/generation_samples.py, keyed by the run's seed, so every validation, resume
and machine generates the same ones. Each sample may generate up to LIMIT_FACTOR x its reference length
+ LIMIT_SLACK codes (within the model's position table); one that has not emitted the stop code by then
counts as not stopped. The limit is the sample's own, so its codes do not depend on its batch-mates.

Nothing here touches training's random state: greedy choice draws nothing, the model's training flag
is restored, and the validation loader reads files in a fixed order. Under torchrun rank 0 alone
generates and writes the set; the others wait for its metrics (World.share_from_main), so every process
decides the best checkpoint and early stopping alike.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainers.data.data_order import StepPlan
from trainers.data.generation_samples import GenerationSamples, generation_samples
from trainers.data.sample_table import SampleTable
from trainers.model.generation import generate_codes
from trainers.run.sample_sets import SampleStore, new_set
from trainers.training.generation_metrics import generation_metrics

log = logging.getLogger("train")

LIMIT_FACTOR = 2  # a sample twice its reference length is babbling: enough to tell, bounded in cost
LIMIT_SLACK = 10
KEEP_SETS = 5  # the newest sets kept under RUN_DIR/samples, besides the best checkpoint's


@dataclass
class ValidationGeneration:
    """The run's generation at validation: the chosen samples, their reference lengths, the store."""

    interval: int
    chosen: GenerationSamples
    ref_lengths: list[int]
    store: SampleStore | None  # rank 0's; None in the other processes of a torchrun job
    highest: int  # the most codes the model's mel position table allows
    pending: tuple[list[torch.Tensor], list[bool]] | None = None  # rank 0: the codes generated, until written

    @classmethod
    def for_run(cls, run: Any) -> "ValidationGeneration | None":
        """None when --sample-interval is 0 or there is no validation set."""
        interval = run.settings.sample_interval
        if not interval or run.val_loader is None:
            return None
        table = SampleTable.of(run.val_loader.dataset.samples)
        chosen = generation_samples(table, run.settings.seed)
        if chosen.left_out:
            log.warning("generation at validation: languages %s get no sample (the set holds at most %d); their "
                        "gen/* metrics are missing. Use fewer validation languages to hear them all",
                        ", ".join(str(lang) for lang in chosen.left_out), len(chosen.indices))
        store = SampleStore(run.cfg.run_dir, KEEP_SETS) if run.world.is_main else None
        if store is not None:
            store.clean_temporaries()
        model = getattr(run.model, "module", run.model)  # DDP's wrapped model under torchrun
        return cls(interval, chosen, [int(table.code_len[i]) for i in chosen.indices], store,
                   model.cfg.max_mel_tokens + 2)

    def due(self, step: int, final: bool) -> bool:
        """Samples at validations of steps divisible by the interval (step 0 included) and at the end."""
        return final or step % self.interval == 0

    def limit(self, ref_length: int) -> int:
        return min(self.highest, LIMIT_FACTOR * ref_length + LIMIT_SLACK)

    def generate(self, run: Any, after_batch: Callable[[int], None]) -> tuple[list[torch.Tensor], list[bool]]:
        """Each chosen sample's codes (cut at its limit) and whether it stopped within it, in chosen order.
        `after_batch(j)` after the j-th batch: the loop's fault point."""
        size = run.hardware.val_batch
        model = getattr(run.model, "module", run.model)
        rows = list(self.chosen.indices)
        limits = [self.limit(n) for n in self.ref_lengths]
        chunks = [rows[i: i + size] for i in range(0, len(rows), size)]
        codes: list[torch.Tensor] = []
        stopped: list[bool] = []
        for j, batch in enumerate(run.val_loader.batches([StepPlan(0, 0, chunks)])):
            mine = limits[len(codes): len(codes) + len(batch.ids)]
            b = batch.to(run.hardware.device)
            out = generate_codes(model, b.condition, b.emo_vec, b.text_ids, b.text_lens, max(mine))
            for c, s, lim in zip(out.codes, out.stopped, mine):
                codes.append(c[:lim])
                stopped.append(bool(s) and len(c) < lim)  # the stop code itself is the lim-th token at most
            after_batch(j)
        return codes, stopped

    def run_at(self, run: Any, after_batch: Callable[[int], None]) -> dict[str, float]:
        """Generate (rank 0) and return the gen/* metrics, the same in every process."""
        keys = sorted(generation_metrics([[]] * len(self.ref_lengths), [False] * len(self.ref_lengths),
                                         [1] * len(self.ref_lengths), self.chosen.languages))
        if not run.world.is_main:
            return dict(zip(keys, run.world.share_from_main([0.0] * len(keys), "generation at validation")))
        codes, stopped = self.generate(run, after_batch)
        self.pending = (codes, stopped)
        metrics = generation_metrics(codes, stopped, self.ref_lengths, self.chosen.languages)
        values = run.world.share_from_main([metrics[k] for k in keys], "generation at validation")
        return dict(zip(keys, values))

    def write(self, step: int, metrics: dict[str, float], best_step: int | None) -> None:
        """Rank 0: the set of this validation, atomically; the newest KEEP_SETS and the best's are kept."""
        if self.store is None or self.pending is None:
            return
        codes, stopped = self.pending
        self.pending = None
        settings = {"search": "greedy", "kv_cache": True, "limit": f"{LIMIT_FACTOR} x reference + {LIMIT_SLACK}",
                    "mel_positions": "upstream"}
        sample_set = new_set(step, self.chosen.ids, self.chosen.languages, codes, stopped, self.ref_lengths,
                             settings, metrics)
        path = self.store.write(sample_set, protect=[best_step] if best_step is not None else [])
        log.info("generation step %d: %d samples written to %s", step, len(codes), path)
