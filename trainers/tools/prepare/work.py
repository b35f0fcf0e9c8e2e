"""One shard's work: its utterances checked, decoded, encoded in batches and written, each recorded once.

The shard's utterances (store.owner: by id, the same on every machine) go through, in order:
  1. text: the backend's front end and tokenizer; empty text, unknown tokens, too many tokens, no language;
  2. header: the audio file's length without decoding (audio.audio_info): missing, unreadable, too short, too
     long for the model (with the text: the model's positions);
  3. batches of similar length (batching.py): each clip decoded by the backend, checked (empty, NaN, silence,
     its exact length), encoded, its features checked against the config and written (store.py), then recorded.
Lines skipped at any step are printed as found and recorded as skipped. The batches are formed over every
utterance of the shard that passed steps 1 and 2, done or not, so a rerun after a kill forms the same batches
and recomputes an interrupted batch whole: its files get the same bytes as an uninterrupted run's (same machine,
same batch size; after an out-of-memory halving, equal within float rounding).
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from trainers.hardware.oom_recovery import OutOfMemoryStop
from trainers.tools.prepare.audio import audio_info
from trainers.tools.prepare.backend import AudioProblem, Clip, FeatureBackend, TextIds
from trainers.tools.prepare.batching import CPU_BATCH, Encoder, next_batch, probe_batch_size
from trainers.tools.prepare.checks import LineLimits, clip_problem, length_problem, text_problem
from trainers.tools.prepare.inputs import Entry, Problem
from trainers.tools.prepare.layouts import Layout
from trainers.tools.prepare.report import Progress, say
from trainers.tools.prepare.store import Journal, Store


@dataclass
class Job:
    entry: Entry
    text: TextIds
    samples: int  # at the backend's rate, from the header (-1: known only once decoded)
    stat: list[int] | None
    done: bool


@dataclass
class ShardWork:
    """What a shard needs: the backend, the limits, where files go, and the names of every id's files."""

    backend: FeatureBackend
    layout: Layout
    limits: LineLimits
    store: Store
    journal: Journal
    encoder: Encoder
    stems: dict[str, str]
    model_dim: int
    max_code: int
    language_problem: Callable[[str | None], str | None] | None
    batch_size: int  # clips of the longest length per batch; 0: from the device (batching.py)
    device: Any

    def run(self, mine: list[Entry], done: dict[str, dict[str, Any]]) -> int:
        """Make every utterance of `mine` not in `done`; the number of utterances made or skipped now."""
        jobs, early = self._check_without_audio(mine, done)
        if early:
            self.journal.append(early)
        jobs.sort(key=lambda j: (-j.samples, j.entry.id))
        todo = sum(not j.done for j in jobs)
        if todo:
            self._size_batches(max(jobs[0].samples, 1))
        progress = Progress(todo)
        writer = ThreadPoolExecutor(1, thread_name_prefix="prepare-batch")  # a batch is written while the next is made
        pending: Future | None = None
        try:
            start = 0
            while start < len(jobs):
                end = next_batch([j.samples for j in jobs], start, self.encoder.budget)
                batch = jobs[start:end]
                start = end
                if all(j.done for j in batch):
                    continue
                files, records = self._batch(batch)
                if pending is not None:
                    pending.result()  # one batch in flight: its errors surface here, its memory is bounded
                pending = writer.submit(self._write, files, records)
                progress.advance(sum(not j.done for j in batch))
            if pending is not None:
                pending.result()
        finally:
            writer.shutdown()
            self.store.close()
            progress.close()
        return todo + len(early)

    def _size_batches(self, longest: int) -> None:
        size = self.batch_size
        how = "--batch-size"
        if not size and self.device.type == "cuda":
            size, how = probe_batch_size(self.encoder, longest, self.device), "the GPU's free memory"
        elif not size:
            size, how = CPU_BATCH, "the CPU's default"
        self.encoder.budget = size * longest
        say(f"batches of up to {size} clips of the longest ({longest / self.backend.audio_rate:.1f} s; {how})")

    def _skip(self, job_or_entry: Job | Entry, problem: Problem, stat: list[int] | None = None) -> dict[str, Any]:
        say(str(problem))
        entry = job_or_entry.entry if isinstance(job_or_entry, Job) else job_or_entry
        return {"id": entry.id, "key": entry.key(), "status": "skipped", "reason": problem.reason,
                "what": problem.what, "todo": problem.todo, "audio_stat": stat}

    def _check_without_audio(self, mine: list[Entry], done: dict[str, dict[str, Any]]
                             ) -> tuple[list[Job], list[dict[str, Any]]]:
        jobs, records = [], []
        for entry in mine:
            stat = _stat(entry)
            record = done.get(entry.id)
            finished = record is not None and record.get("audio_stat") in (None, stat)
            if record is not None and not finished:
                say(f"{entry.source}: {entry.audio.name} changed since its features were made: making them again")
            text = self.backend.text(entry.text, entry.language) if entry.text else None
            problem = text_problem(entry, text, self.limits, self.language_problem)
            if problem is None:
                try:
                    info = audio_info(entry.audio)
                except AudioProblem as exc:
                    problem = Problem(entry.source, exc.reason, f"{entry.audio} {exc.what}", exc.todo)
                else:
                    samples = info.samples_at(self.backend.audio_rate) if info else -1
                    if info:
                        problem = length_problem(entry, samples, self.backend.audio_rate, int(text.ids.size),
                                                 self.backend.code_length(samples), self.limits)
            if problem is not None:
                if not finished:
                    records.append(self._skip(entry, problem, stat))
                continue
            jobs.append(Job(entry, text, samples, stat, finished))
        return jobs, records

    def _batch(self, batch: list[Job]) -> tuple[list[tuple[str, bytes]], list[dict[str, Any]]]:
        """Decode, check and encode one batch: the files and records of its utterances not done before."""
        records: list[dict[str, Any]] = []
        ready: list[tuple[Job, Clip]] = []
        for job in batch:
            problem, clip = self._decoded(job)
            if problem is not None:
                if not job.done:
                    records.append(self._skip(job, problem, job.stat))
            else:
                ready.append((job, clip))
        results = self._encoded(ready, records)
        files: list[tuple[str, bytes]] = []
        kept: list[tuple[Job, Clip, list[tuple[str, bytes]]]] = []
        for (job, clip), features in results:
            if job.done:
                continue
            if features is None:
                continue
            bad = self.layout.check(job.entry.id, features, self.model_dim, self.max_code)
            if bad:
                records.append(self._skip(job, Problem(job.entry.source, "backend_error", bad, "check the audio; "
                                                       "if it is a good recording, report it with the file"), job.stat))
                continue
            mine = self.layout.files(self.stems[job.entry.id], job.text.ids, features)
            files += mine
            kept.append((job, clip, mine))
        return files, records + [self._kept(job, clip, mine) for job, clip, mine in kept]

    def _kept(self, job: Job, clip: Clip, files: list[tuple[str, bytes]]) -> dict[str, Any]:
        e = job.entry
        return {"id": e.id, "key": e.key(), "status": "kept", "audio_stat": job.stat, "text": e.text,
                "speaker": e.speaker, "language": e.language, "text_len": int(job.text.ids.size),
                "code_len": self.backend.code_length(clip.waveform.shape[0]), "seconds": round(clip.seconds, 3),
                "roles": self.layout.roles(self.stems[e.id]), "sizes": {name: len(data) for name, data in files},
                "rate": clip.rate, "source_rate": clip.source_rate, "source_channels": clip.source_channels}

    def _write(self, files: list[tuple[str, bytes]], records: list[dict[str, Any]]) -> None:
        """A batch's files, then its records (a record always means complete files)."""
        if files:
            self.store.write_features(files)
        if records:
            self.journal.append(records)

    def _decoded(self, job: Job) -> tuple[Problem | None, Clip | None]:
        e = job.entry
        try:
            clip = self.backend.audio(e.audio, e.id)
        except AudioProblem as exc:
            return Problem(e.source, exc.reason, f"{e.audio} {exc.what}", exc.todo), None
        samples = clip.waveform.shape[0]
        problem = clip_problem(e, clip, self.limits) or length_problem(
            e, samples, clip.rate, int(job.text.ids.size), self.backend.code_length(samples), self.limits)
        return problem, clip

    def _encoded(self, ready: list[tuple[Job, Clip]], records: list[dict[str, Any]]
                 ) -> list[tuple[tuple[Job, Clip], Any]]:
        """Each (job, clip) with its Features, or None where the backend failed on that clip alone (recorded)."""
        clips = [clip for _, clip in ready]
        try:
            return list(zip(ready, self.encoder.encode(clips)))
        except OutOfMemoryStop:
            raise
        except Exception as exc:  # noqa: BLE001 - a clip the backend fails on is found by trying each alone
            if len(ready) == 1:
                raise
            first = exc
        out, failed = [], 0
        for job, clip in ready:
            try:
                out.append(((job, clip), self.encoder.encode([clip])[0]))
            except OutOfMemoryStop:
                raise
            except Exception as exc:  # noqa: BLE001
                failed += 1
                if not job.done:
                    what = " ".join(str(exc).split())[:200]
                    records.append(self._skip(job, Problem(job.entry.source, "backend_error", f"the feature models "
                                                           f"failed on it ({type(exc).__name__}: {what})", "check the "
                                                           "audio; if it is a good recording, report it with the file"),
                                              job.stat))
                out.append(((job, clip), None))
        if failed == len(ready):
            raise first  # every clip fails alone: the backend is broken, not the clips
        return out


def _stat(entry: Entry) -> list[int] | None:
    try:
        st = os.stat(entry.audio)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]
