"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU, two processes: `accelerate launch` with the recipes' own DeepSpeed configs
(recipes/accelerate/deepspeed_zero{2,3}.yaml) and `--mixed_precision no` (fp32, so that the runs can be compared with
plain data parallelism to float rounding), DeepSpeed's CPU accelerator and gloo between the processes.

Every run is tests/distributed_run.py: scripted answers (the same rollout whatever the weights), 2 iterations of 4
corridor tasks x 2 copies, a KL term (beta 0.01: a reference model, prepared by TRL for DeepSpeed too) and the entropy
bonus, then the evaluation panel. The DeepSpeed runs compute the loss in passes of at most 2 rows
(max_step_samples_per_micro_batch: DeepSpeed accumulates the gradients of a micro-batch's passes), the plain
data-parallel run in one pass per micro-batch. Process 0's corridors have 1 cell, so each of its episodes ends at the first step; process 1's
take 11-12 steps. The runs are launched once per module and shared by the tests.

CI runs this module (deepspeed is in the README's test install, with GIGPO_TRL_REQUIRE_DEEPSPEED=1); elsewhere it is
skipped without deepspeed. DeepSpeed compiles one small op (`deepspeed_shm_comm`) with g++ at its first start
(cached in ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import json

import pytest
import torch
from launchers import finished_run, run_script, torchrun
from optional_packages import require
from test_distributed import SAME_STATISTICS

from bench.gpu_check import deepspeed_launcher

require("deepspeed", "GIGPO_TRL_REQUIRE_DEEPSPEED", "pip install -c constraints.txt -e '.[deepspeed]'")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

UNEVEN_RUN = ("--lengths", "1", "1", "12", "12", "--beta", "0.01", "--entropy-coef", "0.1")
LEARNING_RATE = 1e-3  # distributed_run.py's
# DeepSpeed sums the squares of its flat gradient partitions, DDP those of each parameter: the logged gradient norms
# differ in the last float32 digits (measured: 9e-7 relative). A gradient not averaged over the processes, or one
# process's missing, would change the norm by a factor, not a digit.
LOG_TOLERANCE = 1e-5
# Adam divides each element's step by the root of its own squared gradient (the first step is lr * g / (|g| + 1e-8)),
# so where a gradient is within a few 1e-8 of zero, float rounding in it (see LOG_TOLERANCE) moves the step by a part
# of itself. Measured: ZeRO-2 bitwise equal to DDP; ZeRO-3 at most 1.2e-6 off, in 4 of the 107,072 elements, against
# steps of up to 1.5e-3. A missed, doubled or stale update moves elements by about the learning rate, 100x this bound.
UPDATE_TOLERANCE = 1e-2 * LEARNING_RATE


def deepspeed_run(stage: int, model_dir: str, output_dir, *options: str) -> dict:
    return finished_run(deepspeed_launcher(stage, num_processes=2, mixed_precision="no"), model_dir, output_dir,
                        *UNEVEN_RUN, "--max-step-samples", "2", *options, timeout=600)


@pytest.fixture(scope="module")
def data_parallel(tiny_model_path, tmp_path_factory) -> dict:
    return finished_run(torchrun(2), tiny_model_path, tmp_path_factory.mktemp("ddp"), *UNEVEN_RUN)


@pytest.fixture(scope="module")
def zero2(tiny_model_path, tmp_path_factory) -> dict:
    return deepspeed_run(2, tiny_model_path, tmp_path_factory.mktemp("zero2"))


@pytest.fixture(scope="module")
def zero3(tiny_model_path, tmp_path_factory) -> dict:
    return deepspeed_run(3, tiny_model_path, tmp_path_factory.mktemp("zero3"), "--save-steps", "1")


@pytest.fixture(scope="module")
def zero3_resumed(zero3, tiny_model_path, tmp_path_factory) -> dict:
    return deepspeed_run(3, tiny_model_path, tmp_path_factory.mktemp("zero3-resumed"),
                         "--resume-from", str(zero3["output_dir"] / "checkpoint-1"))


@pytest.fixture(scope="module")
def zero3_lora(tiny_model_path, tmp_path_factory) -> dict:
    return deepspeed_run(3, tiny_model_path, tmp_path_factory.mktemp("zero3-lora"), "--lora")


def parameters(run: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter of the run's model before and after training (ZeRO-3 shards gathered)."""
    return torch.load(run["output_dir"] / "parameters.pt")


def updates(run: dict) -> dict[str, torch.Tensor]:
    written = parameters(run)
    return {name: written["after"][name] - written["before"][name] for name in written["after"]}


def assert_deepspeed_at_stage(run: dict, stage: int) -> None:
    """The run trained with DeepSpeed's engine at `stage` on 2 processes; under ZeRO-3 each process held a shard of
    every parameter (half the elements, rounded up per parameter), under ZeRO-2 whole parameters."""
    assert (run["processes"], run["distributed_type"], run["engine"], run["zero_stage"]) == (
        2, "DistributedType.DEEPSPEED", "DeepSpeedEngine", stage)
    total = run["elements_total"]
    if stage == 3:
        assert all(total / 2 <= held < 0.51 * total for held in run["elements_held"]), (run["elements_held"], total)
    else:
        assert run["elements_held"] == [total, total]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_recipe_trains_with_deepspeeds_engine_at_its_zero_stage(stage, request, data_parallel):
    assert_deepspeed_at_stage(request.getfixturevalue(f"zero{stage}"), stage)
    # What a silent fallback to plain data parallelism reports instead (and fails the check above with):
    assert (data_parallel["engine"], data_parallel["zero_stage"]) == ("DistributedDataParallel", None)
    assert data_parallel["elements_held"] == [data_parallel["elements_total"]] * 2


@pytest.mark.parametrize("stage", [2, 3])
def test_two_deepspeed_iterations_give_the_losses_and_updates_of_plain_data_parallel(stage, request, data_parallel):
    run = request.getfixturevalue(f"zero{stage}")
    assert len(run["logs"]) == len(data_parallel["logs"]) == 2
    for ours, theirs in zip(run["logs"], data_parallel["logs"]):
        for name in SAME_STATISTICS:  # the same rollout
            assert ours[name] == theirs[name], name
        for name in ("loss", "grad_norm", "kl", "entropy"):  # the second iteration's depend on the first update
            assert ours[name] == pytest.approx(theirs[name], rel=LOG_TOLERANCE), name
    assert run["evaluation"]["eval_loss"] == pytest.approx(data_parallel["evaluation"]["eval_loss"], rel=LOG_TOLERANCE)

    ours, theirs = updates(run), updates(data_parallel)
    assert ours.keys() == theirs.keys()
    assert max(step.abs().max().item() for step in theirs.values()) > LEARNING_RATE  # the weights did move
    difference = max((ours[name] - theirs[name]).abs().max().item() for name in theirs)
    assert difference <= UPDATE_TOLERANCE


def test_zero3_processes_generate_in_lock_step_while_one_processes_episodes_are_over(zero3):
    # ZeRO-3 gathers the sharded weights for every generation, a collective: process 0, whose episodes all end at the
    # first step, keeps generating (a dummy prompt) for as long as process 1 plays, in training and in evaluation.
    training, evaluation = zero3["rollouts"]["train"], zero3["rollouts"]["eval"]
    assert training["episode_lengths"][0] == [1, 1, 1, 1]
    assert min(training["episode_lengths"][1]) >= 11
    assert training["generate_calls"] == [max(training["episode_lengths"][1])] * 2
    assert len(zero3["logs"]) == 2  # both iterations completed, on both processes (the run exited with 0)

    # The panel: corridors of 3, 20 and 3 cells, 2 tasks a process (the dataloader repeats one): one process plays the
    # 20-cell corridor to the step limit (15 steps), the other is done after 3.
    assert sorted(max(lengths) for lengths in evaluation["episode_lengths"]) == [3, 15]
    assert evaluation["generate_calls"] == [15, 15]
    assert zero3["evaluation"]["eval_env/panel_tasks"] == 3
    assert zero3["evaluation"]["eval_env/success_rate"] == pytest.approx(2 / 3)


def test_zero3_with_lora_trains_the_adapter_and_leaves_the_sharded_base_alone(zero3_lora):
    assert_deepspeed_at_stage(zero3_lora, 3)
    change = {name: step.abs().max().item() for name, step in updates(zero3_lora).items()}
    adapter = [value for name, value in change.items() if "lora_" in name]
    base = [value for name, value in change.items() if "lora_" not in name]
    assert adapter and min(adapter) > 0  # every adapter matrix moved
    assert base and max(base) == 0.0  # bit-identical, after 3 weight syncs for vLLM too
    assert len(zero3_lora["logs"]) == 2


def test_zero3_lora_weight_sync_hands_vllm_the_merged_gathered_weights_under_vllms_names(zero3_lora):
    written = parameters(zero3_lora)
    after, synced = written["after"], written["synced"]
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): value
            for name, value in after.items() if "lora_" not in name}
    assert synced.keys() == base.keys()  # every base weight, no adapter matrix
    merged = 0
    for name, value in synced.items():
        adapter = "base_model.model." + name.removesuffix(".weight") + ".lora_{}.default.weight"
        if adapter.format("A") in after:  # W + scaling * B @ A, scaling = lora_alpha / r = 2
            expected, merged = base[name] + (after[adapter.format("B")] @ after[adapter.format("A")]) * 2.0, merged + 1
        else:
            expected = base[name]
        assert torch.equal(value, expected), name
    assert merged == 14  # the 7 linear layers of each of the tiny model's 2 decoder layers


def test_zero3_lora_adapter_sync_gathers_the_adapter_alone_and_writes_it_as_trained(zero3_lora):
    written = parameters(zero3_lora)
    adapter = written["adapter"]
    assert adapter["gathered_adapter_only"]  # the sharded base stays sharded
    trained = {name.replace(".default.", "."): value for name, value in written["after"].items() if "lora_" in name}
    assert adapter["tensors"].keys() == trained.keys() and len(trained) == 28  # A and B of 14 adapted layers
    assert all(torch.equal(adapter["tensors"][name], trained[name]) for name in trained)


def test_zero3_checkpoint_resumes_at_its_step_with_its_weights(zero3, zero3_resumed):
    checkpoint = zero3["output_dir"] / "checkpoint-1"
    shards = {path.name for path in (checkpoint / "global_step1").iterdir()}
    assert shards == {f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")}
    assert_deepspeed_at_stage(zero3_resumed, 3)

    # The resumed run played one training rollout, at global step 1: the second iteration.
    records = [json.loads(line) for line in (zero3_resumed["output_dir"] / "gigpo" / "iterations.jsonl").open()]
    assert [record["step"] for record in records if record["mode"] == "train"] == [1]
    # Same rollout, same saved weights and optimizer state: the same second iteration and final weights as the run
    # that was not interrupted, to the bit (the same operations on the same values).
    resumed, uninterrupted = zero3_resumed["logs"][-1], zero3["logs"][-1]
    assert resumed["step"] == uninterrupted["step"] == 2
    assert [resumed[name] for name in ("loss", "grad_norm", "kl")] == [uninterrupted[name] for name in ("loss", "grad_norm", "kl")]
    final, expected = parameters(zero3_resumed)["after"], parameters(zero3)["after"]
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_a_deepspeed_launch_with_accelerate_use_cpu_set_stops_at_once_saying_what_to_change(
        tmp_path, tiny_model_path, monkeypatch):
    # accelerate would turn DeepSpeed off with ACCELERATE_USE_CPU after ZeRO-3 loaded the model split across the
    # processes: the first generation failed with "Padding_idx must be within num_embeddings" (ZeRO-2 would train as
    # plain data parallelism). GiGPOConfig refuses the launch instead.
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    result = run_script(deepspeed_launcher(3, num_processes=2, mixed_precision="no"), tiny_model_path, str(tmp_path))
    assert result.returncode != 0
    assert "ACCELERATE_USE_CPU=true in the environment turns DeepSpeed off" in result.stderr
    assert "unset ACCELERATE_USE_CPU" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_zero2_processes_train_with_rollouts_one_update_ahead_without_hanging(tmp_path, tiny_model_path):
    """async_staleness=1 on two processes under DeepSpeed ZeRO-2: each process's producer plays its own tasks ahead of
    the update with no collective call, while the trainers' collectives stay in their threads."""
    written = finished_run(deepspeed_launcher(2, num_processes=2, mixed_precision="no"), tiny_model_path, tmp_path,
                           "--async-staleness", "1", "--max-steps", "3")
    assert written["processes"] == 2 and written["zero_stage"] == 2 and len(written["logs"]) == 3
    assert [log["async/staleness_max"] for log in written["logs"]] == [0.0, 1.0, 1.0]
    parameters = torch.load(tmp_path / "parameters.pt")
    assert not all(torch.equal(parameters["before"][name], parameters["after"][name]) for name in parameters["before"])
