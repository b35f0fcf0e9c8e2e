"""How much each validation language got worse than the base model, and the guard that acts on it.

Model-agnostic: it sees languages and figures (validation losses, gen/* metrics), nothing of the model.

The measure. At every validation, for every validation language L and metric m (text_loss, mel_loss,
mel_top1 and, at validations that generate (--sample-interval), the gen/* metrics of L), the change from
L's base figure: now - base, and (now - base) / |base| ("_rel"). L's base figures are those of the first
validation of the run that measured L: the step-0 validation of the base model, or for a run resumed or
branched from a checkpoint, the figures that checkpoint carries (recorded at its own run's first
validation). A language first validated later (a --val-manifest added on a resume) is measured from that
validation, and the log says so. A metric the base validation lacked (no generation then) is not measured.

The guard. --forgetting-limit X (a fraction: 0.1 is 10%) watches the base languages: --base-language LANG
(repeatable), else the languages of the replay manifests (--train-manifest F::LANG@SHARE). A validation is
past the limit when the --forgetting-metric (default mel_loss) of a base language is worse than its base
by more than X of the base: higher for the losses and gen/* metrics that are better lower, lower for
mel_top1 and gen/stop_rate. Such a validation is a WARNING naming the language, the metric, base, now and
rise; it is never taken for best.pth (nor is a validation that cannot be judged: a gen/* metric at a
validation that generated nothing), and for early stopping it counts as one without a new best. With
--forgetting-stop the run ends after it (status 0, the final checkpoint saved, best.pth the best
validation within the limit). The verdict is a function of the saved base figures, the last validation's
figures and the guard's settings, so it is saved and restored as early stopping's count is (the "forgetting"
entry of the checkpoint's progress section): a killed run stops at the same validation, a resume of a run
stopped by the guard does nothing, and a resume with a larger limit (or another metric) judges that last
validation again and trains on if it is within. Validations judged before keep their verdict: best.pth is
not re-chosen.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from trainers.training.generation_metrics import HIGHER_IS_BETTER as GEN_HIGHER_IS_BETTER, NO_LANGUAGE
from trainers.training.validation_listeners import Validation, ValidationListener

HIGHER_IS_BETTER = frozenset({"mel_top1", *GEN_HIGHER_IS_BETTER})  # every other directed metric: lower is better
LOSS_METRICS = ("text_loss", "mel_loss", "mel_top1")
_COUNTS = "samples"  # gen/samples: a count, not a figure of the model

Figures = dict[str, dict[str, float]]  # language -> metric -> value


def language_figures(by_lang: dict[str, dict[str, float]], metrics: dict[str, float]) -> Figures:
    """Per validation language ("unknown" for samples without one): its losses and the metrics validation listeners
    added to this validation (gen/*): P/LANG/m as that language's P/m, or the overall P/m where the validation has
    one language."""
    figures = {(lang or NO_LANGUAGE): {k: float(v) for k, v in means.items()} for lang, means in by_lang.items()}
    for key, value in metrics.items():
        prefix, _, rest = key.partition("/")
        parts = rest.split("/") if rest else []
        if not parts or parts[-1] == _COUNTS:
            continue
        if len(parts) == 2 and parts[0] in figures:
            figures[parts[0]][f"{prefix}/{parts[1]}"] = float(value)
        elif len(parts) == 1 and len(figures) == 1:
            next(iter(figures.values()))[key] = float(value)
    return figures


def higher_is_better(metric: str) -> bool:
    """Which way a validation metric is better: mel_top1 and gen/stop_rate higher, the others lower; an ema/
    metric (the same measure of the averaged weights) as its plain name."""
    return metric.removeprefix("ema/") in HIGHER_IS_BETTER


def worse_by(metric: str, base: float, now: float) -> float:
    """How much worse `now` is than `base`, as a fraction of the base (negative: better)."""
    worse = base - now if higher_is_better(metric) else now - base
    if base == 0:
        return 0.0 if worse == 0 else math.copysign(math.inf, worse)
    return worse / abs(base)


@dataclass(frozen=True)
class Guard:
    """The guard's settings for this invocation (limit 0: off)."""

    limit: float = 0.0
    metric: str = "mel_loss"
    languages: tuple[str, ...] = ()
    stop: bool = False

    @classmethod
    def of(cls, settings: Any, replayed: Sequence[str] = ()) -> "Guard":
        """From the run's settings; the base languages default to the replayed ones."""
        languages = tuple(settings.base_languages) or tuple(lang or NO_LANGUAGE for lang in replayed)
        return cls(settings.forgetting_limit, settings.forgetting_metric, languages, settings.forgetting_stop)

    def describe(self) -> str:
        return f"--forgetting-limit {self.limit:g} ({_percent(self.limit, sign=False)}) on {self.metric}"


def language_problems(guard: Guard, validated: Sequence[str], validated_count: int) -> list[str]:
    """The guard needs base languages, each measured by the validation (`validated`: the languages among the
    first `validated_count` validation samples, "" for none)."""
    if not guard.limit:
        return []
    if not guard.languages:
        return [f"--forgetting-limit {guard.limit:g} watches the base languages, and none is named: pass "
                "--base-language LANG (repeatable) or replay manifests (--train-manifest F::LANG@SHARE)"]
    measured = [lang or NO_LANGUAGE for lang in validated]
    missing = [lang for lang in guard.languages if lang not in measured]
    if not missing:
        return []
    return [f"--base-language / --forgetting-limit: the validation does not measure {', '.join(missing)} (its languages "
            f"among the {validated_count} samples validated: {', '.join(measured) or 'none: no --val-manifest'}); add "
            "--val-manifest V::LANG with held-out samples of it, or raise --max-val-batches"]


@dataclass(frozen=True)
class Breach:
    """A base language past the limit at a validation."""

    language: str
    metric: str
    base: float
    base_step: int
    now: float
    rise: float

    def describe(self) -> str:
        """Within a log line: at most about 60 characters."""
        return (f"{self.language} {self.metric} {self.now:.4f}, {_percent(self.rise)} worse than {self.base:.4f} at step "
                f"{self.base_step}")


def _percent(fraction: float, sign: bool = True) -> str:
    return f"{fraction * 100:{'+' if sign else ''}.1f}%"


@dataclass
class Forgetting(ValidationListener):
    """The base figures and the last validation's figures: what the measure and the guard's verdict are computed
    from. A validation listener: measures every validation, may end the run, and saves its state as the "forgetting"
    entry of the progress section (absent before the measure: the next validation is the base)."""

    base: dict[str, dict[str, float]] = field(default_factory=dict)  # language -> {"step": S, metric: value}
    last: dict[str, Any] | None = None  # {"step": S, "figures": Figures} of the last validation
    within_step: int | None = None  # the last validation the guard judged within its limit
    guard: Guard = Guard()  # this invocation's
    best_metric: str = "mel_loss"  # for the stop's message
    key = "forgetting"

    def validated(self, v: Validation) -> None:
        """Each validation language's change from its base figures (log, TensorBoard, history); a validation
        past the limit, or not judged within it, may not be best.pth."""
        figures = language_figures({lang: m.means() for lang, m in v.by_lang.items()}, v.means)
        measured = self.measure(v.step, figures, self.guard)
        v.log.report(v.step, measured.scalars(), measured.lines(), measured.warnings(), measured.fields())
        if measured.within is False:
            v.eligible = False

    def stop(self, v: Validation) -> str | None:
        """--forgetting-stop after a validation past the limit."""
        if not self.stops(self.guard):
            return None
        return "\n".join([
            f"forgetting stop at step {v.step}: past {self.guard.describe()}",
            *(f"forgetting stop: {b.describe()}" for b in self.breaches(self.guard) or []),
            f"best.pth holds step {(v.best or {}).get('step')}, the best {self.best_metric} among the validations "
            "within the limit",
            f"the last validation within the limit was step {self.within_step}",
            "to train on, resume with a larger --forgetting-limit or with --no-forgetting-stop"])

    def halted(self, step: int) -> str | None:
        breaches = self.breaches(self.guard) if self.guard.stop else None
        if not breaches:
            return None
        return "\n".join([f"the run stopped at step {step}, past {self.guard.describe()}",
                          *(f"forgetting stop: {b.describe()}" for b in breaches),
                          "to continue, pass a larger --forgetting-limit or --no-forgetting-stop"])

    def measure(self, step: int, figures: Figures, guard: Guard) -> "Measured":
        """Record a validation: the base figures of languages seen for the first time, the changes, the verdict."""
        first = [lang for lang in figures if lang not in self.base]
        for lang in first:
            self.base[lang] = {"step": step, **figures[lang]}
        self.last = {"step": step, "figures": {lang: dict(values) for lang, values in figures.items()}}
        changes = {lang: self._change(lang, values) for lang, values in figures.items()}
        breaches = self.breaches(guard)
        if breaches == []:
            self.within_step = step
        return Measured(step, changes, first, guard, breaches)

    def _change(self, lang: str, values: dict[str, float]) -> dict[str, float]:
        base = self.base[lang]
        out: dict[str, float] = {"base_step": base["step"]}
        for metric, now in values.items():
            if metric in base:
                out[metric] = now - base[metric]
                out[f"{metric}_rel"] = (now - base[metric]) / abs(base[metric]) if base[metric] else \
                    (0.0 if now == base[metric] else math.copysign(math.inf, now - base[metric]))
        return out

    def breaches(self, guard: Guard) -> list[Breach] | None:
        """The base languages past the limit at the last validation; None where the guard is off or cannot
        judge it (no base language has the metric there, as a gen/* metric at a validation without generation)."""
        if not guard.limit or self.last is None:
            return None
        figures, judged, found = self.last["figures"], False, []
        for lang in guard.languages:
            base, now = self.base.get(lang, {}), figures.get(lang, {})
            if guard.metric not in base or guard.metric not in now:
                continue
            judged = True
            rise = worse_by(guard.metric, base[guard.metric], now[guard.metric])
            if rise > guard.limit:
                found.append(Breach(lang, guard.metric, base[guard.metric], int(base["step"]), now[guard.metric], rise))
        return found if judged else None

    def stops(self, guard: Guard) -> bool:
        """Whether --forgetting-stop ends the run: its last validation is past the limit."""
        return guard.stop and bool(self.breaches(guard))

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy({"base": self.base, "last": self.last, "within_step": self.within_step})

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = copy.deepcopy(state or {"base": {}})
        self.base, self.last, self.within_step = state["base"], state.get("last"), state.get("within_step")
        if self.last is not None:
            self.last["step"] = int(self.last["step"])


@dataclass(frozen=True)
class Measured:
    """One validation's forgetting: what TrainLog writes (log lines, TensorBoard, the run history)."""

    step: int
    changes: dict[str, dict[str, float]]  # language -> {"base_step", metric: change, metric_rel: relative change}
    first: list[str]  # languages whose base figures this validation recorded
    guard: Guard
    breaches: list[Breach] | None  # None: not judged

    @property
    def within(self) -> bool | None:
        """True / False: within / past the limit; None: no guard. A validation the guard cannot judge is not
        within (best.pth is not taken from it)."""
        if not self.guard.limit:
            return None
        return self.breaches == []

    def lines(self) -> list[str]:
        """One line per language measured against an earlier validation (with several languages or a guard)."""
        if len(self.changes) < 2 and not self.guard.limit:
            return []
        out = []
        if self.first:
            out.append(f"forgetting step {self.step}: base figures of {', '.join(self.first)} recorded; later validations "
                       "compare with them")
        for lang, change in sorted(self.changes.items()):
            if change["base_step"] == self.step:
                continue
            # The relative changes only, so the line fits in 120 characters; the absolute ones are in TensorBoard
            # (val/LANG/*_change) and the history.
            parts = [f"{m} {_percent(change[m + '_rel'])}" for m in LOSS_METRICS if m in change]
            mark = " [base]" if lang in self.guard.languages else ""
            out.append(f"forgetting step {self.step} {lang}{mark} vs step {change['base_step']}: " + " ".join(parts))
        return out

    def warnings(self) -> list[str]:
        if not self.breaches:
            return []
        return [*(f"forgetting at step {self.step}: {b.describe()}" for b in self.breaches),
                f"step {self.step} is past {self.guard.describe()}: best.pth is not taken from it",
                "replay more (--train-manifest F::LANG@SHARE), lower --learning-rate, or stop at best.pth"]

    def fields(self) -> dict[str, Any]:
        """What the validation's history entry gains."""
        out: dict[str, Any] = {"forgetting": {lang: dict(change) for lang, change in self.changes.items()}}
        if self.guard.limit:
            out["forgetting_guard"] = {"metric": self.guard.metric, "limit": self.guard.limit,
                                       "languages": list(self.guard.languages), "within": self.within,
                                       "past": [b.language for b in self.breaches or []]}
        return out

    def scalars(self) -> dict[str, float]:
        """TensorBoard: val/LANG/METRIC_change and val/LANG/METRIC_change_rel."""
        out = {}
        for lang, change in self.changes.items():
            for key, value in change.items():
                if key != "base_step":
                    name = f"{key[:-4]}_change_rel" if key.endswith("_rel") else f"{key}_change"
                    out[f"val/{lang}/{name}"] = value
        return out

