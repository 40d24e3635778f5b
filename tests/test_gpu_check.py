"""bench/gpu_check.py on a machine without a GPU: argument parsing, skip logic, the worker processes, results
merging and the summary writer, so that the GPU command does not rot between GPU sessions."""

from __future__ import annotations

import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import CHECKS, Check, main, missing_requirements, run_checks, run_worker, write_summary

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")


@no_cuda
def test_without_a_gpu_every_check_is_skipped_with_its_reason_and_the_summary_says_so(tmp_path):
    report = main(["--output-dir", str(tmp_path), "--summary", str(tmp_path / "gpu.md")])

    assert [r["name"] for r in report["checks"]] == [c.name for c in CHECKS]
    assert all(r["status"] == "skipped" and "no CUDA GPU" in r["reason"] for r in report["checks"])
    assert json.loads((tmp_path / "results.json").read_text())["checks"] == report["checks"]
    summary = (tmp_path / "gpu.md").read_text()
    assert "GPU: none (no CUDA device)" in summary
    assert f"0 passed, 0 failed, {len(CHECKS)} skipped." in summary
    assert "| `deepspeed_zero3` | skipped | 0 | no CUDA GPU" in summary


def test_a_check_names_every_missing_requirement():
    check = Check("x", ("cuda", "deepspeed", "vllm"), 10, "")
    reasons = missing_requirements(check, {"cuda": True, "deepspeed": False, "vllm": False})
    assert reasons == ["deepspeed is not installed (pip install -e '.[deepspeed]')", "vllm is not installed (pip install -e '.[vllm]')"]
    assert missing_requirements(check, {"cuda": True, "deepspeed": True, "vllm": True}) == []


def test_a_failing_or_raising_check_fails_alone_and_the_others_still_run(capsys):
    checks = [Check("a", ("cuda",), 10, ""), Check("b", ("cuda",), 10, ""), Check("c", ("cuda",), 10, ""), Check("d", ("vllm",), 10, "")]

    def raises(options, log):
        raise RuntimeError("CUDA error: an illegal memory access")

    runners = {"a": lambda options, log: {"problems": ["loss not finite"]}, "b": raises,
               "c": lambda options, log: {"problems": [], "x": 1}}
    results = run_checks(checks, None, {"cuda": True, "vllm": False}, runners=runners)

    assert [(r["name"], r["status"]) for r in results] == [("a", "fail"), ("b", "fail"), ("c", "pass"), ("d", "skipped")]
    assert results[1]["figures"]["problems"] == ["RuntimeError: CUDA error: an illegal memory access"]
    assert results[3]["reason"] == "vllm is not installed (pip install -e '.[vllm]')"
    assert "[gpu_check] b: fail" in capsys.readouterr().out


def sample_report() -> dict:
    train = {"iterations": 3, "seconds_per_iteration": 4.25, "losses": [0.1, -0.05, 0.02], "env/success_rate": 0.25,
             "generation/tokens_per_s": 1234.5, "peak_memory_gib": 3.5, "weights_changed_share": 0.97, "problems": []}
    runs = [{"size": "qwen2.5-1.5b", "parameters": 1_543_714_304, "bound": 4, "tasks": 2, "step_samples": 32.0,
             "subsampled_rows": 28.0, "memory_at_update_start_gib": 9.1, "update_peak_gib": 14.2, "problems": []}]
    return {
        "date": "2026-11-22", "seconds": 321.0, "notes": ["measured twice"],
        "machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "gpu_memory_gib": 79.2, "cuda": "13.0",
                    "versions": {"torch": "2.11.0", "vllm": None}},
        "checks": [
            {"name": "gpu_tests", "status": "pass", "seconds": 61.2, "figures": {"summary": "5 passed, 1 skipped in 60s", "problems": []}},
            {"name": "train_full_bf16", "status": "pass", "seconds": 20.4, "figures": train},
            {"name": "deepspeed_zero3", "status": "fail", "seconds": 30.0, "figures": {"problems": ["exit code 1"]}},
            {"name": "vllm_colocate", "status": "skipped", "seconds": 0.0, "reason": "vllm is not installed"},
            {"name": "update_memory", "status": "pass", "seconds": 90.0, "figures": {"runs": runs, "problems": []}},
        ],
    }


def test_the_summary_has_the_machine_each_check_its_figures_and_the_memory_table(tmp_path):
    text = write_summary(sample_report(), tmp_path / "docs" / "gpu.md").read_text()

    assert "GPU: NVIDIA H100 80GB HBM3 x 1 (79.2 GiB), CUDA 13.0." in text
    assert "Versions: torch 2.11.0, vllm not installed." in text
    assert "| `gpu_tests` | pass | 61 | 5 passed, 1 skipped in 60s |" in text
    assert ("| `train_full_bf16` | pass | 20 | 3 iterations, 4.25 s each; loss 0.1, -0.05, 0.02; success 0.25; "
            "1234 tokens/s; peak 3.5 GiB; weights changed share 0.97 |") in text
    assert "| `deepspeed_zero3` | fail | 30 |  **exit code 1** |" in text
    assert "| `vllm_colocate` | skipped | 0 | vllm is not installed |" in text
    assert "| `update_memory` | pass | 90 | bound 4, 32 samples: 5222 MiB added |" in text
    assert "| qwen2.5-1.5b | 1.54B | 4 | 32 | 4 | 9.1 | 14.2 | 5222 | True |" in text
    assert "3 passed, 1 failed, 1 skipped." in text
    assert "## Notes\n\n- measured twice" in text


@no_cuda
def test_update_keeps_the_earlier_checks_that_are_not_run_again(tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(sample_report()))
    report = main(["--only", "gpu_tests", "--update", str(earlier), "--output-dir", str(tmp_path / "out"),
                   "--summary", str(tmp_path / "gpu.md"), "--note", "re-run without a GPU"])

    statuses = {r["name"]: r["status"] for r in report["checks"]}
    assert statuses == {"gpu_tests": "skipped", "train_full_bf16": "pass", "deepspeed_zero3": "fail",
                        "vllm_colocate": "skipped", "update_memory": "pass"}
    assert [r["name"] for r in report["checks"]] == ["gpu_tests", "train_full_bf16", "deepspeed_zero3", "vllm_colocate", "update_memory"]
    assert report["notes"] == ["measured twice", "re-run without a GPU"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--timeout", "0"], "--timeout must be at least 1 second, got 0"),
        (["--jobs", "0"], "--jobs must be at least 1, got 0"),
        (["--time-limit", "0"], "--time-limit must be at least 1 second, got 0"),
        (["--vllm-gpu-memory-utilization", "1.5"], "--vllm-gpu-memory-utilization must be in (0, 1], got 1.5"),
        (["--vllm-kv-cache-gib", "0"], "--vllm-kv-cache-gib must be above 0, got 0.0"),
        (["--only", "train_everything"], "invalid choice: 'train_everything'"),
        (["--update", "/nonexistent/results.json"], "--update /nonexistent/results.json: no such results file"),
        (["--update", "{not_json}"], ": not JSON ("),
        (["--update", "{wrong_keys}"], ": not a results.json of bench/gpu_check.py (no 'checks' and 'seconds')"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys, tmp_path):
    (tmp_path / "not_json").write_text("{checks: ")
    (tmp_path / "wrong_keys").write_text('{"date": "2026-11-22"}')
    argv = [argument.format(not_json=tmp_path / "not_json", wrong_keys=tmp_path / "wrong_keys") for argument in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_list_names_every_check_and_its_needs(capsys):
    main(["--list"])
    out = capsys.readouterr().out
    for check in CHECKS:
        assert check.name in out and ", ".join(check.needs) in out


def test_pytest_counts_are_read_from_its_closing_line():
    assert gpu_check._count("==== 4 passed, 1 failed, 2 skipped in 61.2s ====", "passed") == 4
    assert gpu_check._count("==== 4 passed, 1 failed, 2 skipped in 61.2s ====", "skipped") == 2
    assert gpu_check._count("==== 3 errors in 2s ====", "error") == 3
    assert gpu_check._count("==== 3 passed in 2s ====", "failed") == 0


@pytest.mark.slow
def test_the_training_worker_runs_in_its_own_process_and_reports_its_figures(tiny_model_path):
    result = run_worker("train", {"model": tiny_model_path, "max_steps": 2, "lora": True}, timeout=600)

    assert result["problems"] == []
    assert result["iterations"] == 2 and len(result["losses"]) == 2
    assert result["adapter_changed_share"] > 0.5 and result["base_changed_share"] == 0.0
    assert result["env/step_samples"] > 0 and result["gigpo/singleton_share"] is not None


@pytest.mark.slow
def test_a_worker_that_fails_reports_the_error_instead_of_figures(tmp_path):
    result = run_worker("train", {"model": str(tmp_path / "no-such-model"), "max_steps": 1}, timeout=600)
    assert len(result["problems"]) == 2 and "exit code 1" in result["problems"][1]
    assert "no-such-model" in result["problems"][0]


def test_a_vllm_run_must_log_finite_sampling_metrics_within_the_log_prob_tolerance():
    fine = {"sampling/sampling_logp_difference/mean": [0.02, 0.03, 0.02], "sampling/importance_sampling_ratio/mean": [1.0, 0.99, 1.01]}
    assert gpu_check.vllm_problems(fine) == []

    stale = {**fine, "sampling/sampling_logp_difference/mean": [0.02, 0.6, 0.9]}  # vLLM kept the first weights
    assert gpu_check.vllm_problems(stale) == ["vLLM's log-probs differ from the trainer's by 0.9 (> 0.1): it generated "
                                              "with weights other than the trainer's"]
    missing = {**fine, "sampling/importance_sampling_ratio/mean": [1.0, None, float("nan")]}
    assert "sampling/importance_sampling_ratio/mean not logged and finite at every iteration" in gpu_check.vllm_problems(missing)[0]


def test_an_adapter_mode_check_reports_its_sync_times_and_the_adapters_size():
    figures = {"iterations": 3, "seconds_per_iteration": 9.5, "losses": [0.1, 0.2, 0.3], "env/success_rate": 0.0,
               "generation/tokens_per_s": 2000.0, "peak_memory_gib": 1.5, "adapter_changed_share": 1.0,
               "base_changed_share": 0.0, "sampling/sampling_logp_difference/mean": [0.03, 0.04, 0.04],
               "sync_seconds": [0.21, 0.18, 0.19], "adapter_sync_mib": 18.1, "problems": []}
    text = gpu_check._figures_text("vllm_colocate_lora_adapter", figures)
    assert text.endswith("vLLM - trainer log-prob difference at most 0.04 (mean over tokens); syncs 0.21, 0.18, 0.19 s "
                         "of 18.1 MiB (the adapter)")
    assert gpu_check._figures_text("qlora", {**figures, "sync_seconds": [], "adapter_sync_mib": None}).startswith(
        "3 iterations, 9.5 s each")


def test_jobs_run_checks_at_once_and_report_each_as_it_ends_in_the_checks_order():
    """--jobs 2: two checks that can end only together (each waits for the other at a barrier) both pass; the
    results keep the order of the checks, and `on_result` sees them grow one check at a time."""
    checks = [Check("a", ("cuda",), 10, ""), Check("b", ("cuda",), 10, ""), Check("c", ("cuda",), 10, "")]
    barrier = threading.Barrier(2, timeout=20)

    def meets_the_other(options, log):
        barrier.wait()  # raises BrokenBarrierError (a failed check) if the other never comes
        return {"problems": []}

    seen = []
    runners = {"a": meets_the_other, "b": meets_the_other, "c": lambda options, log: {"problems": []}}
    options = SimpleNamespace(jobs=2, deadline=None)
    results = run_checks(checks, options, {"cuda": True}, runners=runners,
                         on_result=lambda so_far: seen.append([r["name"] for r in so_far]))

    assert [(r["name"], r["status"]) for r in results] == [("a", "pass"), ("b", "pass"), ("c", "pass")]
    assert [len(names) for names in seen] == [1, 2, 3] and seen[-1] == ["a", "b", "c"]


def test_the_time_limit_stops_a_running_check_as_unfinished_and_starts_no_other(tmp_path):
    """A worker still running at --time-limit is stopped (its process timed out) and its check ends 'unfinished';
    a check reached after the limit is 'not run'; both say why."""
    checks = [Check("slow", ("cuda",), 600, ""), Check("later", ("cuda",), 600, "")]

    def slow(options, log):
        finished = gpu_check._run([sys.executable, "-c", "import time; time.sleep(60)"],
                                  gpu_check.check_timeout(options, 600), log)
        return {"problems": [finished["error"]]}

    options = SimpleNamespace(jobs=1, deadline=time.monotonic() + 2, time_limit=2, timeout=None)
    started = time.monotonic()
    results = run_checks(checks, options, {"cuda": True}, runners={"slow": slow, "later": slow})

    assert time.monotonic() - started < 30
    assert results[0]["status"] == "unfinished"
    assert results[0]["figures"]["why"] == "stopped at the run's --time-limit of 2 s"
    assert results[1] == {"name": "later", "status": "not run", "seconds": 0.0,
                          "reason": "the run's --time-limit of 2 s was reached before it started"}
    report = {"date": "2026-11-28", "seconds": 2.0, "notes": [], "checks": results,
              "machine": {"gpu": None, "versions": {}}}
    text = write_summary(report, tmp_path / "gpu.md").read_text()
    assert "0 passed, 0 failed, 0 skipped, 1 unfinished, 1 not run." in text
    assert "| `later` | not run | 0 | the run's --time-limit of 2 s was reached before it started |" in text
    assert "| `slow` | unfinished | " in text and "stopped at the run's --time-limit of 2 s:" in text


def test_each_worker_process_gets_a_port_of_its_own_for_torch_distributed(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    command = [sys.executable, "-c", "import os; print(os.environ['MASTER_PORT'])"]
    ports = {gpu_check._run(command, 60, None)["stdout"].strip() for _ in range(3)}
    assert len(ports) == 3 and all(port.isdigit() for port in ports)
    launcher = gpu_check.deepspeed_launcher(2, num_processes=2)
    assert launcher[launcher.index("--main_process_port") + 1].isdigit()


def test_the_vllm_options_size_each_colocated_engine_and_leave_the_servers_to_its_command_line():
    options = SimpleNamespace(vllm_gpu_memory_utilization=0.05, vllm_kv_cache_gib=2.0)
    assert gpu_check.vllm_settings(options) == {"vllm_gpu_memory_utilization": 0.05,
                                                "vllm_engine_kwargs": {"kv_cache_memory_bytes": 2 * 2**30}}
    assert gpu_check.vllm_settings(SimpleNamespace(vllm_gpu_memory_utilization=0.25, vllm_kv_cache_gib=None)) == {
        "vllm_gpu_memory_utilization": 0.25}
    assert gpu_check.vllm_settings(options, server=True) == {}


@pytest.mark.slow
def test_the_packed_update_check_compares_both_paths_and_dry_runs_on_cpu():
    """The packed_update check's worker at its smallest (3-step conversations, 2 layers of SmolLM2's shape): without
    CUDA it packs with sdpa's dense mask, and its packed log-probs and gradients equal the plain rows'."""
    figures = gpu_check.packed_update_figures(steps=(3,), layers=2)

    assert figures["problems"] == [] and figures["attention"] == ("flex_attention" if torch.cuda.is_available() else "sdpa")
    row = figures["steps"]["3"]
    assert row["step_samples"] == 6 and row["packed"]["seconds"] > 0 and row["plain_rows"]["seconds"] > 0
    assert row["max_log_prob_difference"] < 1e-4 and row["max_relative_gradient_difference"] < 1e-4


def test_an_async_run_must_log_its_metrics_keep_within_its_staleness_and_be_on_policy_at_zero():
    fine = {"async/staleness_mean": [0.0, 1.0, 1.0], "async/staleness_max": [0.0, 1.0, 1.0],
            "async/trainer_wait_s": [3.1, 0.2, 0.1], "async/behaviour_ratio/mean": [1.0, 0.98, 1.01]}
    assert gpu_check.async_problems(fine, staleness=1) == []
    assert gpu_check.async_problems(fine, staleness=0) == [
        "rollouts 1 updates old, above async_staleness=0",
        "behaviour ratio [1.0, 0.98, 1.01] at async_staleness=0, where every rollout is on-policy (1.0)"]
    missing = {**fine, "async/trainer_wait_s": [3.1, None, 0.1]}
    assert gpu_check.async_problems(missing, staleness=1) == [
        "async/trainer_wait_s not logged and finite at every iteration: [3.1, None, 0.1]"]

    run = {"iterations": 3, "seconds_per_iteration": 2.0, "losses": [0.1, 0.2, 0.3], **fine, "problems": []}
    text = gpu_check._figures_text("async_rollouts", {"staleness_0": {**run, "seconds_per_iteration": 3.0},
                                                      "staleness_1": run, "speedup_at_1": 1.5, "problems": []})
    assert text.startswith("staleness 0: 3 s an iteration, loss 0.1, 0.2, 0.3, stale at most 1, trainer waited 3.1, 0.2, 0.1 s")
    assert text.endswith("; staleness 1 is 1.5x the speed of 0")


@pytest.mark.slow
def test_the_async_check_s_training_run_dry_runs_on_cpu(tiny_model_path, tmp_path):
    figures = gpu_check.train_once(tiny_model_path, str(tmp_path), max_steps=2, async_staleness=1)

    assert figures["problems"] == [] and figures["iterations"] == 2
    assert figures["async/staleness_max"][0] == 0.0  # the first rollout is played before any update
    assert all(value <= 1.0 for value in figures["async/staleness_max"])
