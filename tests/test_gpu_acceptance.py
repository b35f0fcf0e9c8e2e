"""benchmarks/gpu_acceptance.py: its dry run (what a machine without a GPU runs) reports every check of both models
(IndexTTS2 and IndexTTS-2.5) and writes the results folder the GPU machine sends back; a check that breaks or
overruns fails alone; the budgets fit the GPU's time; the model FLOPs its MFU divides by are those the model
computes; and the trainer processes start where the package is not installed (the GPU machine runs a copy of the
working tree). The GPU parts themselves need a GPU to run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_acceptance
from benchmarks.acceptance.context import Context
from benchmarks.acceptance.runner import GPU_RUN_BUDGET_S, Check, Outcome, run_check
from tests.benchmark_smokes import run_smokes
from tests.demo_runs import REPO, subprocess_env
from tests.slowness import scaled

RESULT_FILES = {"gpu_acceptance.json", "console.log", "logs.tar.gz", "env.json"}


@pytest.mark.benchmark_smokes("gpu_acceptance.py")
def test_the_dry_run_reports_every_check_and_writes_the_results_folder(tmp_path_factory):
    # --smoke: the dry run with smaller CPU-side measurements, the run tests/test_benchmarks.py also reads
    folder = tmp_path_factory.mktemp("benchmark_smokes")
    done = run_smokes(["gpu_acceptance.py"], folder, at_once=1)["gpu_acceptance.py"]
    assert done.returncode == 0, done.output[-3000:]
    report = json.loads((done.folder / "gpu_acceptance.json").read_text())
    records = {r["name"]: r for r in report["checks"]}
    assert list(records) == gpu_acceptance.NAMES and report["dry_run"] and report["passed"]
    for check in gpu_acceptance.CHECKS:
        record = records[check.name]
        if check.needs_gpus == 0:
            assert record["status"] == "pass", record
        else:  # skipped with why, after its CPU side passed, well within its budget
            assert record["status"] == "skip" and record["cpu_side"] == "passed", record
            assert record["note"].startswith(("--dry-run", "no CUDA device", "needs 2 GPUs")), record
        assert record["seconds"] <= record["budget_s"], record
    lines = [line for line in done.output.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert [line.split(" ")[1].rstrip(":") for line in lines] == gpu_acceptance.NAMES
    # What comes back from the GPU machine: at most 8 files, the console and every process's log among them.
    assert {p.name for p in done.folder.iterdir()} - {"output.log"} == RESULT_FILES
    console = (done.folder / "console.log").read_text()
    assert all(line in console for line in lines)
    with tarfile.open(done.folder / "logs.tar.gz") as archive:
        names = archive.getnames()
        commands = archive.extractfile("logs/commands.txt").read().decode()
    assert "logs/profile.txt" in names and sum(n.endswith(".log") for n in names) >= 8, names
    assert "train_gpt_v2.py" in commands and "capped_trainer.py" in commands
    env = json.loads((done.folder / "env.json").read_text())
    assert {"gpus", "torch", "cuda", "dev_shm", "host_memory", "nvidia_smi"} <= set(env)
    # The CPU side of the step check ran the before/after variants and found where the time goes; both models'
    # masks v2 against v3 (and without dropout), each version's share of the step computed.
    step = records["official_step"]["figures"]
    assert set(step["variants"]) == {"now", "masks_v3", "foreach_adamw", "no_dropout"} and step["micro_batch"] == 2
    assert step["kernels"]["gemm_share"] > 0
    assert all(step["masks"][v]["share_of_step"] is not None for v in ("v2", "v3"))
    # Both models: 2.5's step (its 60,510-wide text head, 3 prefix positions), its losses, its demo resumed
    # bit-identically, its official-width trainer runs on its own corpus and config, its save figures computed.
    step25 = records["official_step_25"]["figures"]
    assert step25["model"] == "2.5" and step25["text_vocabulary"] == 60510 and step25["micro_batch"] == 2
    assert step25["positions"] == step["positions"] - 31
    assert set(step25["variants"]) == {"now", "masks_v3", "no_dropout"} and set(step25["masks"]) >= {"v2", "v3"}
    assert set(records["model_losses"]["figures"]) == {"2.0", "2.5"}
    assert set(records["demo_resume"]["figures"]) == {"2.0 --deterministic", "2.5 --deterministic --dropout-masks v3"}
    assert records["demo_resume"]["figures"]["2.5 --deterministic --dropout-masks v3"]["tensors_differing"] == 0
    assert "--dropout-masks v3" in commands
    # v3's CPU side: its chunked masks, forward, backward and bf16, against the whole-batch function CUDA compiles.
    assert records["dropout_masks"]["figures"]["cells_compared"] > 2 * 411 * 1280 * 2
    assert records["oom_and_precision_25"]["figures"]["halving"]["halved"] == [4, 2]
    assert records["background_save"]["figures"]["2.5_computed"]["bytes_ratio"] > 1
    assert "demo25.yaml" in commands and "official_indextts25/train.jsonl" in commands
    assert report["machine"]["configs"]["2.0"].endswith("checkpoints/config.yaml")
    assert report["machine"]["configs"]["2.5"].endswith("official25/config.yaml")
    # indextts-prepare's feature backends, both models, on upstream's own models (tiny on the CPU side)
    rates = records["prepare_rtf"]["figures"]
    assert rates["indextts2_rtf"] > 0 and rates["indextts25_rtf"] > 0 and rates["clips"] == 3


def test_the_budgets_of_a_one_gpu_run_fit_five_minutes_with_both_models_and_the_machine_first():
    one_gpu = [c for c in gpu_acceptance.CHECKS if c.needs_gpus <= 1 and not c.on_request]
    assert one_gpu == gpu_acceptance.ONE_GPU
    assert sum(c.budget_s for c in one_gpu) <= GPU_RUN_BUDGET_S == 300
    assert gpu_acceptance.CHECKS[0].name == gpu_acceptance.ALWAYS == "machine"
    # A rerun of any failed checks, or a check run on request, fits in what the first run leaves of the same loan.
    assert all(c.budget_s <= GPU_RUN_BUDGET_S / 4 for c in gpu_acceptance.CHECKS if c.needs_gpus <= 1)
    # 2.5's counterparts of the per-model checks run by default; the others cover both models or shared machinery.
    names = {c.name for c in one_gpu}
    assert {"official_step", "official_step_25", "oom_and_precision", "oom_and_precision_25", "demo_resume",
            "model_losses", "background_save"} <= names
    assert [c.name for c in gpu_acceptance.CHECKS if c.on_request] == ["official_trainer"]


def test_an_on_request_check_runs_when_named_and_in_a_dry_run_but_not_by_default_on_a_gpu():
    trainer = next(c for c in gpu_acceptance.CHECKS if c.on_request)
    machine = gpu_acceptance.CHECKS[0]
    assert not gpu_acceptance.selected(trainer, None, dry_run=False)
    assert gpu_acceptance.selected(trainer, None, dry_run=True)
    assert gpu_acceptance.selected(trainer, [trainer.name], dry_run=False)
    assert gpu_acceptance.selected(machine, ["official_step"], dry_run=False)
    assert not gpu_acceptance.selected(gpu_acceptance.CHECKS[1], ["official_step"], dry_run=False)


def test_config_names_a_models_config_by_its_family_and_refuses_two_of_one(tmp_path, capsys):
    """--config replaces the official config of its family (2.5's when it says `version: 2.5`); the checks of the
    other family keep theirs; two configs of one family, or a file that is not a config, exit 2 naming it."""
    from benchmarks.acceptance.corpus import IDX25, write_config, write_official_25

    config25 = write_config(tmp_path / "mine25.yaml", write_official_25(tmp_path / "official25.yaml"), layers=12)
    args = gpu_acceptance.parse_args(["--config", str(config25)])
    ctx = Context(tmp_path, 0, None, True, configs=args.configs)
    assert ctx.gpt(IDX25).layers == 12 and ctx.gpt(IDX25).number_text_tokens == 60509
    assert ctx.gpt().layers == 24 and ctx.gpt().number_text_tokens == 12000  # 2.0: checkpoints/config.yaml
    for argv, named in ((["--config", str(config25), "--config", str(config25)], "a second 2.5 config"),
                        (["--config", str(REPO / "README.md")], "README.md: not a config.yaml")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_acceptance.parse_args(argv)
        assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_the_model_flops_of_both_models_are_those_their_step_computes(tmp_path):
    """MFU divides the model FLOPs of flops.py by the time: counted here by torch's FLOP counter over a real
    forward and backward of each model (the attention on the math backend, whose products it sees), the 2.5 text
    loss's recomputed logits taken out. At width 256 and the official vocabularies the heads dominate, so a head
    counted at the other model's width (12,001 against 60,510 columns) would be off by far more than 1%."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.acceptance.corpus import IDX2, IDX25, build_model, family_of, positions, random_inputs
    from benchmarks.acceptance.flops import flops_per_sample

    ctx = Context(tmp_path, 0, None, True)
    text_len, code_len, samples = 12, 40, 2
    for family in (IDX2, IDX25):
        cfg = ctx.gpt(family, model_dim=256, heads=4, layers=1)
        model = build_model(cfg).eval()  # no dropout: the products only
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            sums = model.loss_sums(**random_inputs(cfg, [text_len] * samples, [code_len] * samples, seed=0))
            (sums["text_ce"] + sums["mel_ce"]).backward()
        recomputed = 2 * cfg.model_dim * (cfg.number_text_tokens + 1) * (text_len + 1) * samples if family == IDX25 else 0
        counted = counter.get_total_flops() - recomputed
        model_flops = samples * flops_per_sample(cfg, text_len, code_len,
                                                 positions(text_len, code_len, family_of(cfg).model.prefix_len))
        assert abs(counted / model_flops - 1) < 0.005, (family, counted, model_flops)


def _context(tmp_path) -> Context:
    return Context(tmp_path, gpus=0, gpu_name=None, dry_run=True)


def _raises(ctx: Context) -> Outcome:
    raise ValueError("broken")


def test_a_check_that_raises_fails_alone_and_the_run_exits_1_naming_the_rerun(tmp_path, monkeypatch, capsys):
    record = run_check(Check("cpu", 0, 10, _raises), _context(tmp_path))
    assert record.status == "fail" and "ValueError" in record.note and "broken" in record.note
    record = run_check(Check("gpu", 1, 10, _raises, _raises), _context(tmp_path))
    assert record.status == "fail" and record.cpu_side == "failed", record
    record = run_check(Check("gpu", 1, 10, _raises, lambda ctx: Outcome(True, {"x": 1})), _context(tmp_path))
    assert record.status == "skip" and record.cpu_side == "passed" and record.note.startswith("no CUDA device")

    fine = Check("fine", 0, 10, lambda ctx: Outcome(True, {}))
    monkeypatch.setattr(gpu_acceptance, "CHECKS", (fine, Check("broken", 0, 10, _raises), fine))
    out = tmp_path / "results"
    assert gpu_acceptance.main(["--out-dir", str(out), "--work-dir", str(tmp_path)]) == 1
    assert [r["status"] for r in json.loads((out / "gpu_acceptance.json").read_text())["checks"]] == ["pass", "fail",
                                                                                                       "pass"]
    printed = capsys.readouterr().out
    assert "FAIL broken: raised ValueError" in printed
    assert "rerun the failed checks (10 s of budgets) with: python benchmarks/gpu_acceptance.py --only broken" \
        in printed
    assert (out / "console.log").read_text() == printed


def test_results_go_to_OUT_when_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_acceptance, "CHECKS", (Check("machine", 0, 10, lambda ctx: Outcome(True, {})),
                                                   Check("other", 0, 10, _raises)))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert gpu_acceptance.main(["--only", "other", "--work-dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "out" / "gpu_acceptance.json").read_text())
    assert [r["name"] for r in report["checks"]] == ["machine", "other"]  # machine always runs
    assert {p.name for p in (tmp_path / "out").iterdir()} == RESULT_FILES


def test_a_check_over_its_budget_fails(tmp_path):
    def slow(ctx: Context) -> Outcome:
        time.sleep(5)
        return Outcome(True, {})

    started = time.monotonic()
    record = run_check(Check("slow", 0, 0.2, slow), _context(tmp_path))
    assert record.status == "fail" and "over its budget" in record.note
    assert time.monotonic() - started < 2


def test_a_check_may_spend_what_earlier_checks_left_and_a_rerun_budgets_what_it_makes_itself(tmp_path):
    """On a GPU the whole run must fit, not each check: a check over its own budget passes within the seconds the
    checks before it left unspent (the second H100 run was 1.0-1.6x slower per check than the first). A check
    run without the one whose runs it reuses is given that one's budget too, and the rerun line counts it."""
    def half_second(ctx: Context) -> Outcome:
        time.sleep(0.5)
        return Outcome(True, {})

    record = run_check(Check("late", 0, 0.2, half_second), _context(tmp_path), extra_s=2.0)
    assert record.status == "pass" and record.budget_s == round(2.2)
    by_name = {c.name: c for c in gpu_acceptance.CHECKS}
    alone = gpu_acceptance.alone_s(by_name["cuda_checkpoint_on_cpu"], {"cuda_checkpoint_on_cpu"})
    assert alone == by_name["demo_resume"].budget_s
    assert gpu_acceptance.alone_s(by_name["cuda_checkpoint_on_cpu"], {"cuda_checkpoint_on_cpu", "demo_resume"}) == 0


def test_a_process_still_running_when_the_budget_ends_is_killed(tmp_path):
    from benchmarks.acceptance.context import CheckTimeout, Job, descendants

    ctx = _context(tmp_path)
    ctx.deadline = time.monotonic() + 0.5
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(CheckTimeout):
        ctx.run(Job(sleeper, subprocess_env()))
    left = [pid for pid in descendants(os.getpid()) if "time.sleep(60)" in _command_line(pid)]
    assert left == []


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _python_without_the_package(folder: Path) -> Path:
    """A virtual environment that sees this Python's packages (torch, numpy, ...) but not an install of this
    project: its site-packages names theirs in a .pth file, whose own .pth files (an editable install's finder)
    are then never run."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=scaled(120))
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import site as host_site
    Path(site, "host_packages.pth").write_text("\n".join(host_site.getsitepackages()) + "\n", encoding="utf-8")
    return python


def test_the_trainer_checks_start_where_the_package_is_not_installed(tmp_path):
    """The GPU machine runs a copy of the working tree, not pip-installed: every process a check starts must get
    the checkout on its path (without it the trainer exits 2, "no trainers package")."""
    python = _python_without_the_package(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the suite points it at this checkout
    hidden = subprocess.run([str(python), "-c", "import trainers"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=scaled(120))
    assert hidden.returncode == 1 and "No module named 'trainers'" in hidden.stderr
    assert subprocess.run([str(python), "-c", "import torch, numpy, yaml"], env=env, cwd=tmp_path,
                          timeout=scaled(120)).returncode == 0
    out = tmp_path / "results"
    done = subprocess.run([str(python), str(REPO / "benchmarks" / "gpu_acceptance.py"), "--smoke", "--only",
                           "official_trainer", "--out-dir", str(out), "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=scaled(600))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = {r["name"]: r for r in json.loads((out / "gpu_acceptance.json").read_text())["checks"]}["official_trainer"]
    assert record["cpu_side"] == "passed" and record["figures"]["micro_batch"] == 2, record


def test_the_summaries_of_a_gpu_run_print_the_figures_a_gpu_gives(tmp_path):
    """The lines a GPU run prints come from branches the CPU side never takes (a peak to compute MFU against,
    synchronisations, the out-of-memory calibration, pinned bytes, a GPU in the dump): given figures shaped as a
    GPU gives them, each prints its line instead of failing on the one run the GPU's time allows."""
    from benchmarks.acceptance import environment, official_checks, save_checks, step_checks
    from benchmarks.acceptance.flops import peak_flops

    gpu = "NVIDIA H100 80GB HBM3"
    cfg = Context(tmp_path, 1, gpu, False).gpt()
    inputs = step_checks.make_inputs(cfg, 4, 20, 30, torch.device("cpu"))
    measured = step_checks.Measured(8.5, 32, {"now": 1.0, "masks_v3": 0.92, "foreach_adamw": 1.1, "no_dropout": 0.9},
                                    61.25,
                                    {"per_step": 5, "where": {"gpt_model.py:331": 4, "optimization.py:75": 1}},
                                    {"gemm_share": 0.7, "attention_share": 0.1, "mask_share": 0.13,
                                     "attention_kernels": ["flash_fwd"], "top": [["nvjet_gemm", 0.3]]}, compile_s=4.2)
    figures = step_checks._figures(cfg, inputs, measured, peak_flops(gpu))
    text = "\n".join(step_checks._lines(figures, "bf16", gpu, 79.1))
    assert "MFU " in text and "probe: micro-batch 32" in text and "AdamW foreach 1.100 s/step -> fused 1.000" in text
    assert "synchronisations per step: 5" in text and "peak memory of the steps: 61.25 GiB" in text
    assert "attention 10%, dropout masks' integer kernels 13% (flash_fwd)" in text
    assert "989.0 TFLOP/s" in text and text.startswith("2.0: bf16, 24 layers")
    assert "dropout masks v2 -> v3: 1.000 -> 0.920 s/step" in text
    assert "the masks' share of the step 10.0% -> 2.2%" in text
    assert figures["masks"]["v3"]["mfu"] > figures["masks"]["v2"]["mfu"] and "took 4.2 s more" in text
    # 2.5's step: the step as it runs now only (the switches are measured on 2.0), its own text head and prefix.
    cfg25 = Context(tmp_path, 1, gpu, False).gpt("indextts25")
    inputs25 = step_checks.make_inputs(cfg25, 4, 20, 30, torch.device("cpu"))
    measured25 = step_checks.Measured(9.0, 30, {"now": 1.1}, 63.5, measured.syncs, measured.kernels)
    figures25 = step_checks._figures(cfg25, inputs25, measured25, peak_flops(gpu))
    text25 = "\n".join(step_checks._lines(figures25, "bf16", gpu, 79.1))
    assert text25.startswith("2.5: bf16, 24 layers at width 1280, text head 60,510 wide, samples of 57 positions")
    assert "MFU " in text25 and "before/after" not in text25 and "peak memory of the steps: 63.5 GiB" in text25

    oom = {"calibration": {"layers": 4, "micro_batch": 32, "step_peak_gib": [14.1, 7.2], "cap_gib": 12.3,
                           "margin_gib": 1.9},
           "halving": {"exit": 0, "halved": [32, 16], "error": "CUDA out of memory. Tried to allocate 1.2 GiB"},
           "halved_vs_uninterrupted": {"steps": [6, 6], "same_samples": True, "train_loss_rel_diff": 2e-6,
                                       "weights_differing": 12, "max_abs_weight_diff": 3e-7},
           "bf16_vs_fp32": {"steps": [6, 6], "bf16_val": {"text_loss": 9.1, "mel_loss": 8.9},
                            "fp32_val": {"text_loss": 9.1, "mel_loss": 8.9}, "val_loss_rel_diff": 1e-4}}
    assert len(official_checks._oom_lines(oom, 32, "2.0")) == 4
    assert official_checks._oom_lines(oom, 32, "2.5")[3].startswith("2.5: bf16 vs fp32 (TF32 off) after 6 steps")
    trainer = {"micro_batch": 31, "seconds": 30.1, "first_step_after_start_s": 20.2, "samples_per_s": 60.0,
               "positions_per_s": 104280, "tokens_per_s": 102000, "mfu": 0.37}
    assert "MFU 37.0%" in official_checks._trainer_lines(trainer, 24)[1]
    save = {"state_gb": 7.7, "tensors": 1269, "loop_blocked_s": 0.4, "write_s": 6.0, "sync_blocked_s": 7.9,
            "reached_the_file": 0, "compared": 1269, "reserve_s": 2.1,
            "2.5_computed": {"state_gb": 8.45, "bytes_ratio": 1.097, "loop_blocked_s": 0.44, "sync_blocked_s": 8.67}}
    lines = save_checks._lines(save, 6.0, 6.0)
    assert "6.0 GiB measured" in lines[2] and lines[3].startswith("2.5: state 8.45 GB (x1.097): 0.44 s blocked")

    ctx = Context(tmp_path, 1, gpu, False)
    ctx.memo["environment"] = {"gpus": [{"name": gpu, "free_gib": 78.9, "total_gib": 79.2}],
                               "nvidia_smi": "name, driver_version, memory.total\n" + f"{gpu}, 580.65.06, 81559 MiB",
                               "torch": "2.11.0+cu130", "cuda": "13.0",
                               "dev_shm": {"free_gib": 60.0, "total_gib": 64.0},
                               "cpu_cores": 16, "host_memory": "120 GiB available"}
    note = environment.machine(ctx).note
    assert note.startswith(f"1 x {gpu}, 78.9 of 79.2 GiB free; driver 580.65.06, torch 2.11.0+cu130, CUDA 13.0")


def test_sigterm_ends_the_run_and_every_process_it_started(tmp_path):
    """A time limit on the whole command (the GPU machine's) sends SIGTERM: the trainers of the check running
    must not go on using the GPU after the command ended, and the report keeps the checks before it."""
    from benchmarks.acceptance.context import descendants

    out, work = tmp_path / "results", tmp_path / "work"
    work.mkdir()
    with open(tmp_path / "output.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gpu_acceptance.py"), "--smoke", "--only",
                                 "demo_resume", "--out-dir", str(out), "--work-dir", str(work)],
                                stdout=log, stderr=subprocess.STDOUT, env=subprocess_env())
    try:
        deadline = time.monotonic() + scaled(120)
        trainers: list[int] = []
        while not trainers and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            trainers = [pid for pid in descendants(proc.pid) if "train_gpt_v2.py" in _command_line(pid)]
        assert trainers, (tmp_path / "output.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(60)) == 143, (tmp_path / "output.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [pid for pid in trainers if Path(f"/proc/{pid}").exists() and "train_gpt_v2.py" in _command_line(pid)] == []
    report = json.loads((out / "gpu_acceptance.json").read_text())
    assert [r["name"] for r in report["checks"]] == ["machine"]
    assert "stopped by SIGTERM during the check after machine" in (out / "console.log").read_text()
    assert list(work.iterdir()) == []  # the work folder went too


def test_kernel_shares_count_kernels_alone_and_each_kernel_once():
    """Rows as torch's profiler named them on the H100 (2026-11-26): the first run divided the kernels' time by a
    total holding the host's "Command Buffer Full" and cudaStreamSynchronize, and counted cuDNN's flash kernels
    (wgmma) as matrix products too: it printed 29% matrix products where the kernels alone give 40%."""
    from benchmarks.acceptance import step_checks

    rows = [("Command Buffer Full", 549_650.0), ("cudaStreamSynchronize", 264_760.0), ("cudaLaunchKernel", 73_980.0),
            ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 400_000.0),
            ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", 100_000.0),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<int, int, int, "
             "at::native::BitwiseXorFunctor<int> >, std::array<char*, 3ul> >", 150_000.0),
            ("void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl>", 350_000.0)]
    shares, table = step_checks.kernel_shares(rows)
    assert (shares["gemm_share"], shares["attention_share"], shares["mask_share"]) == (0.4, 0.1, 0.15)
    assert shares["attention_kernels"] == [rows[4][0][:90]]
    assert "Command Buffer Full" not in "\n".join(table[:4]) and "Command Buffer Full" in table[-3]
