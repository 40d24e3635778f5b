"""`GiGPOConfig`: TRL's `GRPOConfig` plus the GiGPO and environment fields."""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import parse_flag_from_env
from trl import GRPOConfig

from gigpo_trl.options import (
    CONTEXT_OVERFLOW_MODES, EPISODE_STATS_MODES, NORM_MODES, SIGNAL_MODES, TOOL_ANCHOR_MODES, VLLM_LORA_SYNC_MODES,
    engine_kwargs_problems, std_filter_kept_count,
)

# Loss types whose normalization ignores rows with a zero loss mask (the rows that keep processes in lock-step):
# they divide by the token count of the whole generation batch (`num_items_in_batch`). "grpo", "sapo", "dr_grpo"
# and "luspo" average over rows, and "bnpo" divides by each micro-batch's own token count, so a micro-batch of
# padding rows still counts as one of the accumulation steps: padding would shrink their gradients.
SUPPORTED_LOSS_TYPES = ("dapo", "cispo", "vespo")

# GRPOConfig fields whose job GiGPO does otherwise (TRL's reward-function advantages, its tool-calling loop):
# refused unless at their defaults, with what does the job here.
REPLACED_FIELDS = {
    "scale_rewards": ("group", "advantages are normalized by advantage_norm ('mean_std' or 'mean') within each task "
                      "group (episode advantage) and each step group (step advantage)"),
    "reward_weights": (None, "rewards come from the environment (one reward per step); combine reward terms inside "
                       "the environment's step()"),
    "multi_objective_aggregation": ("sum_then_normalize", "there is one reward, the environment's; advantages are "
                                    "normalized by advantage_norm"),
}
DEFAULT_MAX_ENV_STEPS = 50
# history_length "auto": the window of text environments (environment_factory classes play the whole conversation)
DEFAULT_HISTORY_LENGTH = 2
# TRL's default per_device_eval_batch_size, which an unset one is derived from.
TRL_EVAL_BATCH_SIZE = 8


@dataclass
class GiGPOConfig(GRPOConfig):
    r"""
    Configuration of [`GiGPOTrainer`]: every field of TRL's `GRPOConfig`, plus the fields below.

    `num_generations` is the group size N: the number of identically-seeded copies of each task.
    Every environment step is one training sample. The defaults are those of the GiGPO paper
    (arXiv 2505.10978) and its reference implementation.

    On a machine without an accelerator an unset `bf16` means auto: bf16 autocast (with `use_cpu`) on CPUs
    with bf16 instructions (x86 AVX-512 BF16 or AMX), where it trained the CPU quickstart 1.46x faster to the
    same held-out success (docs/performance.md), and fp32 elsewhere (there bf16 matmuls are about 10x slower);
    on other machines without CUDA it means fp32. Set `bf16` explicitly to override. Under `accelerate launch`
    with a DeepSpeed config an unset `bf16` follows the launch's `mixed_precision` instead (DeepSpeed trains at
    it), and a `bf16` that contradicts it is refused. Without CUDA, under a multi-process launcher (`torchrun
    --nproc_per_node N`, `accelerate launch --num_processes N`), `use_cpu` defaults to True, so that the processes
    form one run (gloo).
    """

    # GiGPO
    gamma: float = field(
        default=0.95, metadata={"help": "Discount of the step return-to-go G_t = r_t + gamma * G_{t+1} (in [0, 1])."}
    )
    step_advantage_weight: float = field(
        default=1.0,
        metadata={"help": "omega in A = A_E + omega * A_S. 0 gives step-wise GRPO, the baseline for comparisons."},
    )
    advantage_norm: str = field(
        default="mean_std",
        metadata={"help": "Normalization of both advantages: 'mean_std' ((x - mean) / (std + 1e-6)) or 'mean' (x - mean).",
                  "choices": list(NORM_MODES)},
    )
    episode_stats: str = field(
        default="steps",
        metadata={"help": "Statistics of the episode advantage: over all step rows of the group ('steps', the "
                  "reference code) or one score per trajectory ('trajectories', the paper's Eq. 3).",
                  "choices": list(EPISODE_STATS_MODES)},
    )
    invalid_action_penalty: float = field(
        default=0.1,
        metadata={"help": "Subtracted from the episode score and step value of a step whose answer breaks the "
                  "<action>...</action> format."},
    )
    similarity_threshold: float | None = field(
        default=None,
        metadata={"help": "None: steps share a step group when their anchor states are equal. A value in (0, 1]: "
                  "text anchors whose similarity ratio reaches it share a step group (e.g. 0.95)."},
    )

    step_advantage_lambda: float = field(
        default=1.0,
        metadata={"help": "lambda of the step value (in [0, 1]; an extension beyond the paper: docs/algorithm.md, "
                  "'Bootstrapped step value'). "
                  "1 (the paper): a step is valued by its own discounted return-to-go G_t. Below 1 the return "
                  "bootstraps from the states the trajectory reaches, each valued by the group (the mean G_t of its "
                  "step group): Gl_t = r_t + gamma * ((1 - lambda) * V(next state) + lambda * Gl_{t+1}), so a move of "
                  "a losing episode into a state from which other copies won ranks above one into a dead end. "
                  "0 ranks a state's moves by the value of the state each leads to."},
    )

    # Environment and rollout
    env_name: str = field(
        default="sokoban",
        metadata={"help": "Environment: a name registered with gigpo_trl.register_env ('textworld', 'textworld_express', "
                  "'sokoban', 'rooms', 'openenv', ...) or a gymnasium id."},
    )
    env_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of the environment's factory (a dict, or JSON on the command line)."},
    )
    max_env_steps: int = field(
        default=DEFAULT_MAX_ENV_STEPS,
        metadata={"help": "Steps after which an episode is cut off (a failure, logged as truncated). TRL's "
                  "max_tool_calling_iterations, when set, sets it to that number + 1 (the first reply and the rounds "
                  "after tool results)."},
    )
    history_length: int | str | None = field(
        default="auto",
        metadata={"help": "What a step's prompt shows of the episode before it: K, the last K (observation, action) "
                  "exchanges, each prompt written anew; 'conversation' (or None), the whole conversation, each prompt "
                  "the previous one's token ids, its answer as generated and what came back; 'auto' (default), the "
                  "whole conversation for TRL environment_factory classes (as TRL plays them) and K=2 for text "
                  "environments."},
    )
    context_overflow: str = field(
        default="truncate",
        metadata={"help": "Conversation mode (history_length 'conversation'): what an episode does when its next prompt "
                  "would not fit the model's context (max_position_embeddings, or vllm_max_model_length, less "
                  "max_completion_length). 'truncate' (default): the episode ends there, truncated, with the reason in "
                  "its trajectory record (logged as env/context_overflow_share). 'drop_oldest': the oldest whole "
                  "exchanges (an answer and what came back) are dropped until it fits, the system message, task and "
                  "first observation kept; that prompt is rendered from its messages once, and the turns after it "
                  "extend it token for token (logged as env/context_trimmed_share: the step samples whose prompt "
                  "dropped exchanges). An episode whose first prompt and latest exchange do not fit still ends "
                  "truncated.", "choices": list(CONTEXT_OVERFLOW_MODES)},
    )
    drop_oldest_target: float = field(
        default=0.75,
        metadata={"help": "With context_overflow 'drop_oldest': the share of the prompt's room the dropped exchanges "
                  "bring it down to (the fewest that fit the room where none reaches it). Below 1, the turns after a "
                  "drop extend that prompt token for token for a while, instead of each dropping one more exchange "
                  "and being rendered anew."},
    )
    prompt_template: str | None = field(
        default=None,
        metadata={"help": "Wording of the step prompts: a template name ('default', 'sokoban', 'numbered': answer with "
                  "an action's number, 'numbered_one_shot': the same shown once, for small models, 'action_one_shot': answer "
                  "with the action's text, shown once) or a JSON file of PromptTemplate fields. None: the environment's default."},
    )
    tool_anchor: str = field(
        default="state",
        metadata={"help": "Anchors of TRL environment_factory classes: 'state' (the class's anchor property or "
                  "gigpo_anchor(), else a hash of its public plain-data attributes) or 'tool_calls' (the tool calls "
                  "made so far).", "choices": list(TOOL_ANCHOR_MODES)},
    )
    step_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds an environment step may take; a hung environment ends its own trajectory only."},
    )
    env_processes: bool = field(
        default=True,
        metadata={"help": "Run each environment in its own worker process (survives crashes and hangs). False runs "
                  "them in the trainer's process (only exceptions are caught)."},
    )
    env_reset_attempts: int = field(
        default=3,
        metadata={"help": "Times an environment's reset is tried, each on a fresh environment, before its copy of the "
                  "task counts as unable to start (training and evaluation alike). The attempts come before the "
                  "episode's first turn, so they add no generation call. An evaluation reports the tasks that still "
                  "could not be played (eval_env/panel_unplayed) and leaves them out of its figures."},
    )
    async_staleness: int | None = field(
        default=None,
        metadata={"help": "Rollouts that run ahead of the update. None (default): synchronous, generate then update. "
                  "S >= 0: a producer thread plays the next task batches (every copy of a task together, never "
                  "dropped) with a snapshot of the policy that lags the trained one by at most S updates, while the "
                  "trainer updates; the update is decoupled PPO (the clip on the ratio to the weights at the update, "
                  "each stale row's tokens weighted by their ratio to the snapshot that sampled them, truncated or "
                  "masked by vllm_importance_sampling_mode, _clip_min and _clip_max). 0 plays each rollout after the "
                  "update before it: the synchronous run, through the producer. HF generation through the prefix cache "
                  "only (not vLLM, ZeRO-3, FSDP or vision models); no dynamic sampling (docs/configuration.md)."},
    )
    stop_after_failed_rollouts: int = field(
        default=3,
        metadata={"help": "Training rollouts in a row in which every trajectory failed by its environment (raised, "
                  "crashed, hung, could not start, or a service it calls stayed down past its wait; "
                  "env/env_error_share 1.0) after which the run saves a checkpoint and stops with an error that names "
                  "the environment, the reasons and how to resume. The updates of such rollouts train on nothing and do "
                  "not step the optimizer. 0: never stop. Rollouts where some trajectories played go on as usual (the "
                  "failed ones end; the share is logged)."},
    )
    log_trajectories: int = field(
        default=8,
        metadata={"help": "Episodes of each rollout written to output_dir/gigpo/trajectories for the run report's "
                  "trajectory viewer (0: none). Per-rollout GiGPO records always go to output_dir/gigpo/iterations.jsonl."},
    )
    eval_greedy: bool = field(
        default=False,
        metadata={"help": "Play the held-out tasks of evaluate() with greedy decoding instead of sampling."},
    )
    vllm_lora_sync: str = field(
        default="merged",
        metadata={"help": "How vLLM generates with a LoRA model (use_vllm with a PEFT model). 'merged': after every "
                  "update each adapted layer's merged weight W + scaling * B @ A is computed (out of place: the base "
                  "stays bit-identical) and the whole model is loaded into vLLM. 'adapter': vLLM is started with LoRA "
                  "enabled (the adapter's rank) and keeps the base weights it loaded; after every update only the "
                  "adapter is written to a temporary folder and loaded as a new version, which every generation names: "
                  "a sync moves the adapter's bytes instead of the model's, ZeRO-3 gathers the adapter only, and a "
                  "4-bit (QLoRA) base, which cannot be merged, generates with vLLM. vllm_mode='colocate' only. The "
                  "measured costs of both: docs/launching.md.", "choices": list(VLLM_LORA_SYNC_MODES)},
    )
    vllm_engine_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "vllm_mode='colocate': keyword arguments added to the vLLM engine TRL starts (vLLM's "
                  "EngineArgs: a dict, or JSON on the command line), e.g. {\"kv_cache_memory_bytes\": 2147483648, "
                  "\"enforce_eager\": true}. Where several training processes share one GPU, give the KV cache its size: "
                  "from vllm_gpu_memory_utilization alone, vLLM sizes it by profiling the GPU's free memory while it "
                  "starts, and counts what the other processes allocate meanwhile as its own. The arguments TRL "
                  "already sets are refused, each naming the setting that sets it."},
    )
    max_step_samples_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "Upper bound on the step samples of one forward/backward pass: it bounds the update's peak "
                  "memory whatever the episode lengths, and changes nothing else. The step samples of a rollout are split "
                  "into steps_per_generation micro-batches; a micro-batch of more rows than the bound runs its "
                  "forward/backward passes in chunks of at most the bound, with the gradients accumulated, so every sample "
                  "trains and the loss and gradient are those of the whole micro-batch. Evaluation runs its loss in passes "
                  "of at most this many rows (None: per_device_eval_batch_size). None: no bound (one pass per micro-batch)."},
    )
    packed_update: bool = field(
        default=True,
        metadata={"help": "Fold the rows of each forward pass of the update (the loss's, the old and the reference "
                  "log-probs') into a prefix trie, so that each token the rows share (the instructions, a step group's "
                  "prompt, a common start of the answers) is forwarded and back-propagated once; each token's "
                  "attention sees exactly what it sees in its own row, so log-probs, loss and gradients are those of the "
                  "plain path within fp32 rounding. Off by itself, with one warning, for a model it cannot be exact "
                  "for (an attention that takes no 4-D mask, non-rotary positions, sliding windows, vision inputs). "
                  "max_step_samples_per_micro_batch still counts rows. False: every row forwarded whole (TRL's path)."},
    )
    generation_prefix_cache: bool = field(
        default=True,
        metadata={"help": "Generation with transformers (not vLLM, whose prefix caching does the same): keep the keys "
                  "and values of the prompt tokens forwarded during a rollout and reuse them for every prompt that "
                  "starts with the same tokens, so that each distinct prompt token is forwarded once per rollout: the "
                  "instructions every prompt starts with, a task's copies' identical first prompts, and in "
                  "conversation mode each episode's previous prompt and answer (a T-turn episode's prefill is then "
                  "O(T) tokens, not O(T^2)). The tokens are those of generation without it, up to floating-point "
                  "summation order (exactly in fp32; under bf16 autocast a near-tie can go the other way, as a change "
                  "of batch does without it). Off by itself, with one warning, where it cannot serve (a sliding-window or static "
                  "cache, continuous batching, ZeRO-3 or FSDP). False: every prompt is "
                  "forwarded whole at every turn (TRL's generate)."},
    )
    dynamic_sampling_max_rounds: int = field(
        default=0,
        metadata={"help": "Dynamic sampling (DAPO's): after a training rollout, the task groups without signal "
                  "(dynamic_sampling_signal; by default: all copies got the same return, e.g. none won) are dropped "
                  "before the update, and rounds of further tasks, drawn from the training set "
                  "(reproducibly: by the seed, the step, the process and the round), are played, as many tasks a round "
                  "as the rollout had, until each process holds that many groups with a signal or this many extra "
                  "rounds were played; the update then trains on what it has (a warning says when it is short; "
                  "logged as dynamic_sampling/*). 0: off. Evaluation is never filtered."},
    )
    dynamic_sampling_signal: str = field(
        default="returns",
        metadata={"help": "What makes a task group worth an update under dynamic sampling: 'returns' (DAPO's rule, "
                  "docs/algorithm.md, 'Dynamic sampling'): its trajectories' returns are not all equal; 'advantages': some step "
                  "sample's advantage A = A_E + omega * A_S is not 0, which also keeps groups of equal returns whose "
                  "copies differ in off-format answers (invalid_action_penalty) or, with gamma < 1, in how soon they "
                  "won.", "choices": list(SIGNAL_MODES)},
    )
    reward_std_filter_ratio: float | None = field(
        default=None,
        metadata={"help": "Reward-std filtering (RAGEN's rollout_filter_ratio with its 'std' type, arXiv 2504.20073): "
                  "of the n task groups of a training rollout over all processes (after dynamic sampling, when it is "
                  "on too: the groups it kept), only the ceil(ratio x n) whose trajectories' returns have the largest "
                  "standard deviation (Bessel's) reach the update; the rest are dropped, and no task is played to "
                  "replace them. Ties are broken by a permutation drawn from the seed and the step. In (0, 1]; 1 keeps "
                  "every group and only logs the stds (logged as reward_std_filter/*). None: off. Evaluation is never "
                  "filtered."},
    )

    # TRL turns checkpointing on by default under transformers' old name, `gradient_checkpointing`, which transformers
    # 5.23 deprecates with a FutureWarning on every config built: the same default, under the new name.
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Enable activation checkpointing to trade compute for memory (about 20%% slower training). "
                          "Unset: on, TRL's default, unless the deprecated alias gradient_checkpointing is set.",
                  "nargs": "?", "const": True},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (transformers), used only when that is unset.",
                  "nargs": "?", "const": True},
    )
    # TRL's default of 8 rows refuses a group size it does not divide (the paper's 5 copies) even where nothing is
    # evaluated; the groups of an evaluation never cross processes here, so each process's batch holds whole groups.
    per_device_eval_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows of an evaluation batch on each process: whole task groups of num_generations_eval (or "
                  f"num_generations) copies. Unset: the smallest multiple of the group size that is at least "
                  f"{TRL_EVAL_BATCH_SIZE} (TRL's default), e.g. 10 for the paper's 5 copies."},
    )

    def history_shown(self, tool_environment: bool) -> int | None:
        """The `history_length` a run plays with: K past exchanges, or None for the whole conversation ('auto': None
        for TRL environment_factory classes, `DEFAULT_HISTORY_LENGTH` for text environments)."""
        if self.history_length == "auto":
            return None if tool_environment else DEFAULT_HISTORY_LENGTH
        return self.history_length

    def __post_init__(self):
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True
        if self.per_device_eval_batch_size is None:
            group = self.num_generations_eval or self.num_generations or 1
            self.per_device_eval_batch_size = group * math.ceil(TRL_EVAL_BATCH_SIZE / group)
        self._follow_deepspeed_launch()
        if self.bf16 is None and not self.fp16 and not _cuda_available():
            self.bf16 = _cpu_only() and _cpu_has_bf16_instructions()
            if self.bf16:
                self.use_cpu = True  # transformers takes bf16 on a machine without a GPU only with use_cpu
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _cuda_available():
            # Several processes (torchrun) on a machine without CUDA: without use_cpu, accelerate would make
            # every process train alone; with it they form one run over gloo.
            self.use_cpu = True
        self._check_trajectories_per_process()
        if isinstance(self.env_kwargs, str):
            try:
                self.env_kwargs = json.loads(self.env_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"env_kwargs must be a dict or a JSON object string, got {self.env_kwargs!r}: {exc}") from None
        self.env_kwargs = dict(self.env_kwargs or {})
        self.history_length = _history_length(self.history_length)
        if isinstance(self.vllm_engine_kwargs, str):
            try:
                self.vllm_engine_kwargs = json.loads(self.vllm_engine_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"vllm_engine_kwargs must be a dict or a JSON object string, got "
                                 f"{self.vllm_engine_kwargs!r}: {exc}") from None
        if self.max_tool_calling_iterations is not None:
            turns = self.max_tool_calling_iterations + 1
            if self.max_env_steps not in (DEFAULT_MAX_ENV_STEPS, turns):
                raise ValueError(f"invalid GiGPOConfig: max_tool_calling_iterations={self.max_tool_calling_iterations} "
                                 f"means {turns} turns an episode, but max_env_steps={self.max_env_steps}: set one of them")
            self.max_env_steps = turns
        super().__post_init__()
        self._check_gigpo_fields()

    def _follow_deepspeed_launch(self) -> None:
        """Under `accelerate launch` with a DeepSpeed config, DeepSpeed trains at the launch's mixed precision and
        transformers refuses a config that says otherwise: an unset bf16 follows the launch, a contradicting one is
        refused with what to change. ACCELERATE_USE_CPU would turn DeepSpeed off after the model was loaded split
        across the processes: refused too (without a GPU, DeepSpeed runs on the CPU by itself)."""
        if not parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
            return
        if parse_flag_from_env("ACCELERATE_USE_CPU"):
            raise ValueError(
                f"invalid launch: ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']} in the environment turns DeepSpeed off "
                "in accelerate, so this DeepSpeed launch would train without DeepSpeed (ZeRO-2) or fail at its first "
                "generation with the model already split across the processes (ZeRO-3): unset ACCELERATE_USE_CPU. Without a "
                "GPU, DeepSpeed runs on the CPU as it is (docs/launching.md, 'DeepSpeed without a GPU')"
            )
        launched_bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"
        if self.bf16 is None and not self.fp16:
            self.bf16 = launched_bf16
            if launched_bf16 and _cpu_only():
                self.use_cpu = True  # transformers takes bf16 on a machine without a GPU only with use_cpu
                if not _cpu_has_bf16_instructions():
                    warnings.warn("the DeepSpeed launch trains in bf16, which this CPU emulates (no AVX-512 BF16 or AMX): "
                                  "about 10x slower than fp32 here; accelerate launch --mixed_precision no trains in fp32",
                                  stacklevel=2)
        elif bool(self.bf16) != launched_bf16:
            raise ValueError(
                f"invalid GiGPOConfig: bf16={self.bf16}, but the DeepSpeed launch trains with mixed_precision="
                f"{os.environ.get('ACCELERATE_MIXED_PRECISION', 'no')} "
                "(the accelerate config's mixed_precision, bf16 in recipes/accelerate/deepspeed_zero*.yaml, or accelerate "
                f"launch --mixed_precision): launch with --mixed_precision {'bf16' if self.bf16 else 'no'}, or leave bf16 "
                "unset to follow the launch"
            )

    def _check_gigpo_fields(self) -> None:
        problems = []
        if self.advantage_norm not in NORM_MODES:
            problems.append(f"advantage_norm={self.advantage_norm!r} is not one of {NORM_MODES}")
        if self.episode_stats not in EPISODE_STATS_MODES:
            problems.append(f"episode_stats={self.episode_stats!r} is not one of {EPISODE_STATS_MODES}")
        if not 0.0 <= self.gamma <= 1.0:
            problems.append(f"gamma={self.gamma} must be in [0, 1]")
        if self.invalid_action_penalty < 0:
            problems.append(f"invalid_action_penalty={self.invalid_action_penalty} must be >= 0")
        if self.similarity_threshold is not None and not 0.0 < self.similarity_threshold <= 1.0:
            problems.append(f"similarity_threshold={self.similarity_threshold} must be None or in (0, 1]")
        lam = self.step_advantage_lambda
        if not (isinstance(lam, numbers.Real) and 0.0 <= lam <= 1.0):  # NaN fails too
            problems.append(f"step_advantage_lambda={lam!r} must be a number in [0, 1]")
        if self.max_env_steps < 1:
            problems.append(f"max_env_steps={self.max_env_steps} must be >= 1")
        problems += self._async_problems()
        if self.stop_after_failed_rollouts < 0:
            problems.append(f"stop_after_failed_rollouts={self.stop_after_failed_rollouts} must be >= 0 (0: never stop)")
        if self.log_trajectories < 0:
            problems.append(f"log_trajectories={self.log_trajectories} must be >= 0")
        if self.tool_anchor not in TOOL_ANCHOR_MODES:
            problems.append(f"tool_anchor={self.tool_anchor!r} is not one of {TOOL_ANCHOR_MODES}")
        if self.context_overflow not in CONTEXT_OVERFLOW_MODES:
            problems.append(f"context_overflow={self.context_overflow!r} is not one of {CONTEXT_OVERFLOW_MODES}")
        if not 0.0 < self.drop_oldest_target <= 1.0:
            problems.append(f"drop_oldest_target={self.drop_oldest_target} must be in (0, 1]")
        if isinstance(self.history_length, int) and self.history_length < 0:
            problems.append(f"history_length={self.history_length} must be >= 0 (or 'conversation', 'auto')")
        if self.step_timeout <= 0:
            problems.append(f"step_timeout={self.step_timeout} must be > 0")
        if self.env_reset_attempts < 1:
            problems.append(f"env_reset_attempts={self.env_reset_attempts} must be >= 1 (1: no second attempt)")
        if self.max_step_samples_per_micro_batch is not None and self.max_step_samples_per_micro_batch < 1:
            problems.append(f"max_step_samples_per_micro_batch={self.max_step_samples_per_micro_batch} must be >= 1")
        if self.dynamic_sampling_max_rounds < 0:
            problems.append(f"dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} must be >= 0 (0: no dynamic "
                            "sampling)")
        if self.dynamic_sampling_signal not in SIGNAL_MODES:
            problems.append(f"dynamic_sampling_signal={self.dynamic_sampling_signal!r} is not one of {SIGNAL_MODES}")
        problems += self._reward_std_filter_problems()
        problems += self._vllm_lora_sync_problems()
        problems += engine_kwargs_problems(self.vllm_engine_kwargs, self.use_vllm, self.vllm_mode)
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            problems.append(
                f"loss_type={self.loss_type!r} normalizes per row or per micro-batch, so the zero-weight rows that keep "
                f"processes in lock-step would shrink its gradient; use one of {SUPPORTED_LOSS_TYPES}, which divide by the "
                f"token count of the whole rollout ('dapo' is GiGPO's token mean)"
            )
        if self.per_device_train_batch_size * self.steps_per_generation % self.num_generations:
            problems.append(_trajectories_message(self.per_device_train_batch_size, self.steps_per_generation,
                                                  self.num_generations))
        for name, (default, replacement) in REPLACED_FIELDS.items():
            if getattr(self, name) != default:
                problems.append(f"{name}={getattr(self, name)!r} has no effect in GiGPO ({replacement}); leave it at {default!r}")
        if self.top_entropy_quantile < 1.0 and self.max_step_samples_per_micro_batch is not None:
            problems.append(
                f"top_entropy_quantile={self.top_entropy_quantile} selects the tokens above an entropy quantile of each "
                f"micro-batch, and max_step_samples_per_micro_batch={self.max_step_samples_per_micro_batch} may split a "
                "micro-batch into chunks, whose quantiles differ from the micro-batch's: the update would change with the "
                "memory bound. Leave max_step_samples_per_micro_batch unset (None) or top_entropy_quantile at 1.0"
            )
        num_generations_eval = self.num_generations_eval or self.num_generations
        if self.per_device_eval_batch_size % num_generations_eval:
            problems.append(
                f"per_device_eval_batch_size={self.per_device_eval_batch_size} must be a multiple of the eval group size "
                f"(num_generations_eval or num_generations = {num_generations_eval})"
            )
        if problems:
            raise ValueError("invalid GiGPOConfig: " + "; ".join(problems))

    def _async_problems(self) -> list[str]:
        """Settings the async producer cannot honour (`async_staleness`), each named with why."""
        staleness = self.async_staleness
        if staleness is None:
            return []
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            return [f"async_staleness={staleness!r} must be None (synchronous) or an int >= 0"]
        problems = []
        if self.use_vllm:
            problems.append(f"async_staleness={staleness} generates with a snapshot of the policy through the prefix "
                            "cache, and use_vllm=True generates with vLLM: colocated vLLM shares the trainer's device and "
                            "process, so it cannot run ahead of the update, and the vLLM server producer is not built "
                            "yet. Leave async_staleness None with vLLM")
        if self.dynamic_sampling_max_rounds:
            problems.append(f"async_staleness={staleness} with dynamic_sampling_max_rounds="
                            f"{self.dynamic_sampling_max_rounds}: the producer plays the dataloader's batches in order, "
                            "and drawing more task groups from it is not built yet; use reward_std_filter_ratio, which "
                            "works on each rollout as it is consumed, or no async")
        if not self.generation_prefix_cache:
            problems.append(f"async_staleness={staleness} needs generation_prefix_cache=True: the producer generates "
                            "through the prefix cache")
        if self.loss_type == "vespo":
            problems.append(f"async_staleness={staleness} with loss_type='vespo', whose weights read TRL's vLLM "
                            "importance-sampling ratio: the stale rows' ratio to their behaviour policy would be applied "
                            "twice; use 'dapo' or 'cispo'")
        return problems

    def _vllm_lora_sync_problems(self) -> list[str]:
        """A mode that is not one of VLLM_LORA_SYNC_MODES, or the adapter mode where vLLM would not apply it."""
        if self.vllm_lora_sync not in VLLM_LORA_SYNC_MODES:
            return [f"vllm_lora_sync={self.vllm_lora_sync!r} is not one of {VLLM_LORA_SYNC_MODES}"]
        if self.vllm_lora_sync != "adapter":
            return []
        if not self.use_vllm:
            return ["vllm_lora_sync='adapter' says how vLLM gets the adapter, and use_vllm=False generates without "
                    "vLLM: set use_vllm=True, or leave vllm_lora_sync at 'merged'"]
        if self.vllm_mode != "colocate":
            return [f"vllm_lora_sync='adapter' runs with vllm_mode='colocate' only, got vllm_mode={self.vllm_mode!r}: "
                    "TRL 1.16's server client names no adapter in its generation requests and sends weights by NCCL "
                    "broadcast, and vLLM's server loads adapters from files on its own machine. Use vllm_mode='colocate' "
                    "(one GPU, the LoRA setting), or vllm_lora_sync='merged' with the server"]
        return []

    def _reward_std_filter_problems(self) -> list[str]:
        """A ratio that is not a number in (0, 1], or one below 1 that keeps every task group of a rollout."""
        ratio = self.reward_std_filter_ratio
        if ratio is None:
            return []
        if isinstance(ratio, bool) or not (isinstance(ratio, numbers.Real) and 0.0 < ratio <= 1.0):  # NaN fails too
            return [f"reward_std_filter_ratio={ratio!r} must be None (off) or a number in (0, 1]"]
        groups = self.generation_batch_size // self.num_generations  # a rollout's task groups, all processes
        if ratio < 1.0 and std_filter_kept_count(groups, ratio) == groups:
            remedy = f"a ratio of at most {groups - 1}/{groups} or " if groups > 1 else ""
            return [f"reward_std_filter_ratio={ratio} keeps ceil({ratio} x {groups}) = {groups} of the {groups} task "
                    f"group(s) of a rollout (generation_batch_size / num_generations, all processes): it would never "
                    f"drop one. Use {remedy}more tasks per rollout (1 keeps every group on purpose and only logs their "
                    f"stds)"]
        return []

    def _check_trajectories_per_process(self) -> None:
        """Before GRPOConfig's own check, whose message ("generation_batch_size must be divisible by
        num_generations") speaks of prompts, not of tasks and copies."""
        if self.generation_batch_size is not None:  # steps_per_generation then depends on the process count
            return
        steps = self.steps_per_generation or self.gradient_accumulation_steps
        if self.per_device_train_batch_size * steps % self.num_generations:
            raise ValueError("invalid GiGPOConfig: " + _trajectories_message(self.per_device_train_batch_size, steps,
                                                                            self.num_generations))


def _trajectories_message(per_device_train_batch_size: int, steps_per_generation: int, num_generations: int) -> str:
    trajectories = per_device_train_batch_size * steps_per_generation
    step = num_generations // math.gcd(num_generations, steps_per_generation)
    working = -(-per_device_train_batch_size // step) * step
    return (
        f"each process plays per_device_train_batch_size x steps_per_generation = {per_device_train_batch_size} x "
        f"{steps_per_generation} = {trajectories} trajectories per rollout, which must be whole groups of "
        f"num_generations = {num_generations} copies of a task (a task's copies never split across processes). "
        f"Trajectories per rollout = tasks x copies; each of the steps_per_generation micro-batches of the update holds "
        f"the step samples of per_device_train_batch_size trajectories. A setting that works: "
        f"per_device_train_batch_size={working} with steps_per_generation={steps_per_generation} "
        f"({working * steps_per_generation // num_generations} task(s) x {num_generations} copies per process)"
    )


def _history_length(value: int | str | None) -> int | str | None:
    """`history_length` as given (a YAML or command-line string included): an int K, None for the whole conversation,
    or 'auto'."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("conversation", "none", "null"):
        return None
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"history_length={value!r} must be a number of past exchanges (K >= 0), 'conversation' "
                         "(None: the whole conversation) or 'auto'") from None


def _cuda_available() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def _cpu_only() -> bool:
    """No accelerator at all (CUDA, XPU, MPS, ...): training runs on the CPU."""
    import torch  # noqa: PLC0415

    return torch.accelerator.current_accelerator() is None


def _cpu_has_bf16_instructions() -> bool:
    """The CPU computes bf16 natively (x86 AVX-512 BF16 or AMX); elsewhere bf16 on the CPU is emulated."""
    import torch  # noqa: PLC0415

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
