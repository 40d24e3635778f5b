"""The benchmarks of bench/: the iteration timing and the dynamic-sampling measurements of bench_rollout, cpu_precision's
pass timings and the update-memory estimate. (The research code's tests are in research/tests/.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_iteration_timing_splits_each_iteration_into_its_parts(tiny_model_path):
    from bench.bench_rollout import bench_iterations

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"
    rows = bench_iterations(str(smoke), 2, tiny_model_path)

    assert len(rows) == 2
    for row in rows:
        assert set(row["parts_s"]) == {"generation", "environments", "rollout loop", "advantages", "update"}
        assert all(seconds >= 0 for seconds in row["parts_s"].values()) and row["parts_s"]["update"] > 0
        assert row["seconds"] == pytest.approx(sum(row["parts_s"].values()))
        assert row["step_samples"] > 0 and row["generated_tokens_per_s"] > 0


def test_the_median_iteration_takes_each_figure_over_iterations_separately():
    from bench.bench_rollout import median_iteration

    parts = ["generation", "environments", "rollout loop", "advantages", "update"]
    rows = [{"seconds": total, "step_samples": samples, "generated_tokens_per_s": tokens, "parts_s": dict(zip(parts, split)),
             "prompt_tokens": prompt, "prefill_tokens": prefill}
            for total, samples, tokens, split, prompt, prefill in [
                (10.0, 20, 5.0, (4, 0, 0, 0, 6), 900, 300), (30.0, 30, 9.0, (9, 1, 0, 0, 20), 1000, 200),
                (20.0, 10, 7.0, (5, 0, 1, 0, 14), 800, 400)]]
    median = median_iteration(rows)

    assert median["seconds"] == 20.0 and median["generated_tokens_per_s"] == 7.0
    assert (median["prompt_tokens"], median["prefill_tokens"]) == (900, 300)
    assert median["step_samples_per_s"] == 1.0  # of 2.0, 1.0 and 0.5 per second: not 20 samples / 20 s
    assert median["parts_s"] == {"generation": 5, "environments": 0, "rollout loop": 0, "advantages": 0, "update": 14}


@pytest.mark.timeout(300)
def test_configs_are_timed_side_by_side_in_one_run(tiny_model_path, tmp_path, capsys):
    import yaml

    from bench.bench_rollout import compare_iterations

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"
    shorter = tmp_path / "shorter_answers.yaml"
    shorter.write_text(yaml.safe_dump(yaml.safe_load(smoke.read_text()) | {"max_completion_length": 4}))
    medians = compare_iterations([str(smoke), str(shorter)], 1, tiny_model_path)

    assert list(medians) == [str(smoke), str(shorter)]
    assert all(median["seconds"] > 0 and median["step_samples_per_s"] > 0 for median in medians.values())
    side_by_side = capsys.readouterr().out.split("Median iteration, side by side:")[1]
    assert str(smoke) in side_by_side and str(shorter) in side_by_side


@pytest.mark.timeout(300)
def test_a_config_field_is_timed_at_each_value_side_by_side(tiny_model_path, capsys):
    from bench.bench_rollout import main

    smoke = str(Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml")
    main(["--iterations", smoke, "--vary", "generation_prefix_cache", "false", "true", "--num-iterations", "1",
          "--model", tiny_model_path])

    out = capsys.readouterr().out
    side_by_side = out.split("Median iteration, side by side:")[1].strip().splitlines()
    assert [line.split(":")[0].strip() for line in side_by_side] == [
        f"{smoke} generation_prefix_cache=false", f"{smoke} generation_prefix_cache=true"]
    forwarded = [re.search(r"(\d+) of (\d+) prompt tokens forwarded", line).groups() for line in side_by_side]
    (plain, prompts), (cached, same_prompts) = [(int(a), int(b)) for a, b in forwarded]
    assert plain == prompts and cached < prompts  # TRL's generate reads every prompt whole; the cache, shared ones once
    assert f"Iterations of {smoke} --generation_prefix_cache true" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("recipe_arguments", "signal"), [
    # Sokoban, by advantages: in these rollouts the copies' returns are equal (3 step penalties) but not their off-format
    # answers, so the invalid-answer penalty gives every group a signal
    (["--dynamic_sampling_signal", "advantages"], True),
    (["--env_name", "rooms", "--max_env_steps", "3", "--invalid_action_penalty", "0"], False),  # no treasure in reach
], ids=["every-group-with-a-signal", "no-group-with-a-signal"])
def test_dynamic_sampling_is_measured_with_and_without_on_the_same_first_tasks(tiny_model_path, tmp_path,
                                                                                 recipe_arguments, signal):
    from bench.bench_rollout import main

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"  # 2 tasks x 2 copies
    output = tmp_path / "dynamic_sampling.json"
    main(["--dynamic-sampling", str(smoke), "--max-rounds", "1", "--num-iterations", "2", "--model", tiny_model_path,
          "--output", str(output), *recipe_arguments])

    figures = json.loads(output.read_text())
    rows = figures["rows"]
    assert [(row["iteration"], row["arm"]) for row in rows] == [(0, "without"), (0, "with"), (1, "with"), (1, "without")]
    for k in (0, 1):
        without, with_ = ({row["arm"]: row for row in rows if row["iteration"] == k}[arm] for arm in ("without", "with"))
        assert with_["first_round_seeds"] == without["first_round_seeds"] and len(without["first_round_seeds"]) == 2
        assert without["extra_rounds"] == 0 and without["groups_rolled"] == without["groups_kept"] == 2
        assert without["update_samples"] == without["step_samples"]  # without it every sample is in the update
        assert with_["groups_rolled"] == 2 * (1 + with_["extra_rounds"])
        assert with_["groups_kept"] == min(2, with_["groups_with_signal"])
        assert with_["groups_dropped"] == with_["groups_rolled"] - with_["groups_with_signal"]
        assert with_["nonzero_samples"] >= with_["groups_kept"]  # a kept group has a sample with a nonzero advantage
        assert with_["update_groups_with_signal"] == with_["groups_kept"]
        assert without["update_groups_with_signal"] == without["groups_with_signal"]
        if signal:
            assert with_["extra_rounds"] == 0 and without["groups_with_signal"] == 2
        else:  # every round's groups dropped, up to the limit; nothing to train on
            assert with_["extra_rounds"] == 1 and with_["groups_dropped"] == 4 and with_["update_samples"] == 0
            assert without["nonzero_samples"] == 0 and without["update_samples"] == 2 * 2 * 3
        for row in (without, with_):
            assert 0 <= row["nonzero_samples"] <= row["update_samples"] <= row["step_samples"]
            assert row["rollout_s"] >= row["extra_rollout_s"] >= 0 and (row["extra_rollout_s"] > 0) == (row["extra_rounds"] > 0)
    for arm, summary in figures["arms"].items():
        of_arm = [row for row in rows if row["arm"] == arm]
        assert summary["nonzero_advantage_share"] == pytest.approx(
            sum(row["nonzero_samples"] for row in of_arm) / max(sum(row["update_samples"] for row in of_arm), 1))
        assert summary["groups_rolled"] == sum(row["groups_rolled"] for row in of_arm)


@pytest.mark.timeout(300)
def test_reward_std_filtering_is_measured_with_and_without_on_the_same_first_tasks(tiny_model_path, tmp_path):
    from bench.bench_rollout import main

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"  # 2 tasks x 2 copies
    output = tmp_path / "std_filter.json"
    main(["--dynamic-sampling", str(smoke), "--max-rounds", "0", "--reward-std-filter-ratio", "0.5",
          "--num-iterations", "2", "--model", tiny_model_path, "--output", str(output)])

    figures = json.loads(output.read_text())
    assert figures["reward_std_filter_ratio"] == 0.5 and figures["max_rounds"] == 0
    for k in (0, 1):
        without, with_ = ({row["arm"]: row for row in figures["rows"] if row["iteration"] == k}[arm]
                          for arm in ("without", "with"))
        assert with_["first_round_seeds"] == without["first_round_seeds"]
        assert without["groups_kept"] == 2 and without["groups_dropped"] == 0 and "std_threshold" not in without
        assert without["update_samples"] == without["step_samples"]
        # ceil(0.5 x 2) = 1 of the 2 groups, no extra round; the kept one has the larger std
        assert (with_["groups_rolled"], with_["groups_kept"], with_["groups_dropped"],
                with_["extra_rounds"]) == (2, 1, 1, 0)
        assert with_["kept_std_mean"] == with_["std_threshold"] >= with_["dropped_std_mean"]
        assert with_["update_groups_with_signal"] == (with_["std_threshold"] > 0)
        assert 0 < with_["update_samples"] < with_["step_samples"]
    assert figures["arms"]["with"]["groups_kept"] == 2 and "std_threshold_mean" in figures["arms"]["with"]
    assert "std_threshold_mean" not in figures["arms"]["without"]


@pytest.mark.parametrize("arguments", [["--max-rounds", "0"], ["--num-iterations", "0"]])
def test_the_dynamic_sampling_bench_refuses_a_run_that_measures_nothing(arguments, capsys):
    from bench.bench_rollout import main

    with pytest.raises(SystemExit):
        main(["--dynamic-sampling", "config.yaml", *arguments])
    assert "--max-rounds and --num-iterations must be >= 1" in capsys.readouterr().err


def test_recipe_arguments_are_refused_outside_the_dynamic_sampling_bench(capsys):
    from bench.bench_rollout import main

    with pytest.raises(SystemExit):
        main(["--iterations", "config.yaml", "--use_cpu", "true"])
    assert "unrecognized arguments: --use_cpu true" in capsys.readouterr().err


def test_cpu_precision_kernels_time_every_pass_in_both_precisions(tiny_model_path, tmp_path):
    from bench.cpu_precision import main

    output = tmp_path / "kernels.json"
    result = main(["--kernels", "--repeats", "2", "--model", tiny_model_path, "--output", str(output)])

    assert set(result["kernel_seconds"]) == {"forward_backward_8x256", "generate_16x200_plus_12"}
    for by_precision in result["kernel_seconds"].values():
        assert set(by_precision) == {"fp32", "bf16"}
        assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in by_precision.values())  # the warm-up not kept
    for name, ratio in result["bf16_over_fp32_median_time"].items():
        seconds = result["kernel_seconds"][name]
        assert ratio == pytest.approx(sum(seconds["bf16"]) / sum(seconds["fp32"]))  # the median of two is their mean
    assert json.loads(output.read_text()) == result and "avx512_bf16" in result["cpu"]


def test_the_update_memory_estimate_reproduces_the_h100_runs_and_refuses_the_plan_that_ran_out_of_memory():
    from bench.update_memory import BYTES_PER_TOKEN_LAYER_HIDDEN, pass_memory_gib, plan_fits, run_memory_gib

    smollm2 = dict(parameters=134_515_008, hidden_size=576, num_layers=30)  # the embedded SmolLM2-135M
    h100_gib = 79.2

    def per_run(rows: int) -> float:
        coefficient = BYTES_PER_TOKEN_LAYER_HIDDEN["cuda", "bf16"] * smollm2["hidden_size"]
        pass_gib = pass_memory_gib(coefficient, rows, 355, smollm2["num_layers"])  # setting D: 355 tokens at most
        return run_memory_gib(smollm2["parameters"], pass_gib=pass_gib, reference_model=False, total_gib=h100_gib,
                              vllm_share=None)

    assert 21 <= per_run(64) <= 25  # measured: one process peaked at about 23 GiB with 64 samples per pass
    with pytest.raises(SystemExit, match="the plan does not fit: 9 runs"):
        plan_fits(9 * per_run(64), h100_gib, "9 runs")  # setting D as designed: all 9 died of CUDA out of memory
    plan_fits(4 * per_run(16), h100_gib, "4 runs")  # as run: 3-4 runs at 16 per pass took 26-36 GiB in all
    assert 4 * per_run(16) <= 36
    # vLLM colocate's share counts once per run: 4 runs at TRL's default 0.3 of the GPU cannot share it.
    with_vllm = run_memory_gib(smollm2["parameters"], pass_gib=1.0, reference_model=False, total_gib=h100_gib,
                               vllm_share=0.3)
    with pytest.raises(SystemExit, match="lower vllm_gpu_memory_utilization"):
        plan_fits(4 * with_vllm, h100_gib, "4 runs with vLLM")


@pytest.mark.timeout(300)
def test_the_conversation_bench_measures_its_four_arms_and_the_prefill_side_by_side(tiny_model_path, tmp_path,
                                                                                       monkeypatch):
    from bench.bench_conversation import main

    output = tmp_path / "conversation"
    monkeypatch.setattr("sys.argv", ["bench_conversation.py", "--model", tiny_model_path, "--layers", "1", "--steps",
                                     "3", "--shape", "12", "5", "3", "--repeats", "1", "--output", str(output)])
    main()
    row = json.loads((output / "bench_conversation.json").read_text())["steps"]["3"]
    update = row["update"]
    assert set(update) == {"conversation_packed", "conversation_plain_rows", "window_2_packed", "trl_one_sample"}
    assert all(arm["cpu_s_per_step_sample"] > 0 for arm in update.values())
    # a conversation's step samples packed forward its tokens once, as TRL's one sample does; the plain rows, each whole
    assert update["conversation_packed"]["positions_forwarded"] <= update["trl_one_sample"]["positions_forwarded"]
    assert row["ratios"]["plain_rows_vs_packed_positions"] > 1.5
    rollout = row["rollout"]
    assert rollout["prefix_cache"]["prompt_tokens"] == rollout["generate"]["prompt_tokens"]  # the same conversations
    assert rollout["prefix_cache"]["prefill_tokens"] < rollout["generate"]["prompt_tokens"] / 2  # each token about once

    monkeypatch.setattr("sys.argv", ["bench_conversation.py", "--model", tiny_model_path, "--layers", "1", "--first-turn",
                                     "2", "3", "--shape", "12", "5", "3", "--repeats", "1", "--output", str(output)])
    main()  # raises where the prefix cache's greedy tokens differ from generate's
    first = json.loads((output / "bench_first_turn.json").read_text())
    assert first["prompts"] == 6 and first["prefill_tokens"]["prefix_cache"] < first["prefill_tokens"]["generate"]
