"""The names of the metrics a GiGPO run logs that more than one module spells, defined once: the modules that log
them (`gigpo_trl.metrics`, `advantages`, `loops`, `dynamic_sampling`, `run_logs`) and those that read them back
(`records`, `report`, `recipe`) import them from here. A family of names made from dataclass fields
(`StepGroupStats`, `LoopCounts`, `SamplingCounts`) has its prefix here and the names other modules read.

TRL prefixes the metrics of an evaluation with "eval_" (`evaluation_name`): `env/success_rate` of a training rollout
is `eval_env/success_rate` of an evaluation.
"""

from __future__ import annotations

EVAL_PREFIX = "eval_"

# Episodes and steps of a rollout, and the held-out panel of an evaluation (`gigpo_trl.metrics`).
ENV_PREFIX = "env/"
SUCCESS_RATE = "env/success_rate"  # per task type: SUCCESS_RATE + "/" + type
RETURN_MEAN = "env/return_mean"
RETURN_STD = "env/return_std"
EPISODE_LENGTH_MEAN = "env/episode_length_mean"
TRUNCATED_SHARE = "env/truncated_share"
ENV_ERROR_SHARE = "env/env_error_share"
CONTEXT_OVERFLOW_SHARE = "env/context_overflow_share"  # ended as a step's prompt would not fit the model's context
# step samples whose prompt dropped the conversation's oldest exchanges to fit the context (context_overflow 'drop_oldest')
CONTEXT_TRIMMED_SHARE = "env/context_trimmed_share"
INVALID_ACTION_RATE = "env/invalid_action_rate"  # answers that broke the format: what invalid_action_penalty charges
# of all answers, those that broke the format and still named an admissible action, which the lenient parser mapped
# them onto and the environment played
INVALID_MAPPED_RATE = "env/invalid_mapped_rate"
STEP_SAMPLES = "env/step_samples"
GROUP_RETURN_STD = "env/group_return_std"
PANEL_TASKS = "env/panel_tasks"
PANEL_UNPLAYED = "env/panel_unplayed"
PANEL_UNPLAYED_TASKS = "env/panel_unplayed_tasks"  # a text, logged by an evaluation that could not play every task
PASS_AT_PREFIX = "env/pass@"  # env/pass@k (and env/pass@k/<task type>): an evaluation of k or more copies per task
# The names above, which an environment's own metrics (`info["metrics"]`, logged as env/<name>) may not take.
TRAINER_ENV_METRICS = (
    SUCCESS_RATE, RETURN_MEAN, RETURN_STD, EPISODE_LENGTH_MEAN, TRUNCATED_SHARE, ENV_ERROR_SHARE, CONTEXT_OVERFLOW_SHARE,
    CONTEXT_TRIMMED_SHARE, INVALID_ACTION_RATE, INVALID_MAPPED_RATE, STEP_SAMPLES, GROUP_RETURN_STD, PANEL_TASKS, PANEL_UNPLAYED,
    PANEL_UNPLAYED_TASKS,
)

# GiGPO's step groups and advantages (`gigpo_trl.advantages.StepGroupStats`, `gigpo_trl.metrics`).
GIGPO_PREFIX = "gigpo/"
NUM_ROWS = "gigpo/num_rows"
NUM_STEP_GROUPS = "gigpo/num_step_groups"
STEP_GROUP_SIZE_MEAN = "gigpo/step_group_size_mean"
STEP_GROUP_SIZE_MAX = "gigpo/step_group_size_max"
SINGLETON_SHARE = "gigpo/singleton_share"
NONZERO_STEP_ADVANTAGE_SHARE = "gigpo/nonzero_step_advantage_share"
EPISODE_ADVANTAGE_STD = "gigpo/episode_advantage_std"
STEP_ADVANTAGE_STD = "gigpo/step_advantage_std"
UPDATE_STEP_SAMPLES = "gigpo/update_step_samples"
NONZERO_ADVANTAGE_SHARE = "gigpo/nonzero_advantage_share"
# GRPOTrainer's standard metric in GiGPO's terms: the share of task groups whose copies all got the same return.
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"

# Revisits, stays, turn-backs and cycles of the episodes' states (`gigpo_trl.loops.LoopCounts`).
LOOPS_PREFIX = "loops/"
REVISIT_SHARE = "loops/revisit_share"
STAY_SHARE = "loops/stay_share"
TURN_BACK_SHARE = "loops/turn_back_share"
CYCLE_END_SHARE = "loops/cycle_end_share"
DISTINCT_STATES_MEAN = "loops/distinct_states_mean"

# Where a rollout's time went, and the update's (`gigpo_trl.metrics`).
ROLLOUT_S = "timing/rollout_s"
GENERATION_S = "timing/generation_s"
ENV_S = "timing/env_s"
ADVANTAGES_S = "timing/advantages_s"
UPDATE_S = "timing/update_s"
TOKENS_PER_S = "generation/tokens_per_s"
PROMPT_TOKENS = "generation/prompt_tokens"  # the tokens of the rollout's prompts
# of those, the tokens the model forwarded (HF generation; fewer where the prefix cache held them; not logged under vLLM)
PREFILL_TOKENS = "generation/prefill_tokens"

# Dynamic sampling's task groups and rounds (`gigpo_trl.dynamic_sampling.SamplingCounts`).
DYNAMIC_SAMPLING_PREFIX = "dynamic_sampling/"
GROUPS_ROLLED = "dynamic_sampling/groups_rolled"
GROUPS_KEPT = "dynamic_sampling/groups_kept"
GROUPS_DROPPED = "dynamic_sampling/groups_dropped"
GROUPS_SURPLUS = "dynamic_sampling/groups_surplus"
GROUPS_MISSING = "dynamic_sampling/groups_missing"
EXTRA_ROUNDS = "dynamic_sampling/extra_rounds"
EXTRA_ROLLOUT_S = "dynamic_sampling/extra_rollout_s"

# Reward-std filtering's task groups (`gigpo_trl.dynamic_sampling.StdFilterCounts`).
REWARD_STD_FILTER_PREFIX = "reward_std_filter/"
STD_FILTER_GROUPS_KEPT = "reward_std_filter/groups_kept"
STD_FILTER_GROUPS_KEPT_ZERO_STD = "reward_std_filter/groups_kept_zero_std"

# Rollouts that run ahead of the update (`async_staleness`, `gigpo_trl.async_rollouts`): the rollout's staleness (the
# updates between the policy that played it and the one that trains on it; mean and max over the processes' rollouts),
# the rollouts played and not yet taken, the seconds the trainer waited for it and the producer waited for admission,
# and the stale rows' behaviour weights (proximal / behaviour per token, after truncation or masking).
ASYNC_PREFIX = "async/"
ASYNC_STALENESS_MEAN = "async/staleness_mean"
ASYNC_STALENESS_MAX = "async/staleness_max"
ASYNC_QUEUE_DEPTH = "async/queue_depth"
ASYNC_TRAINER_WAIT_S = "async/trainer_wait_s"
ASYNC_PRODUCER_WAIT_S = "async/producer_wait_s"
ASYNC_BEHAVIOUR_RATIO = "async/behaviour_ratio/"  # + "mean", "min", "max"
ASYNC_BEHAVIOUR_MASKED_SHARE = "async/behaviour_masked_share"

# A training step's gradient norm over the median of those logged before it (`gigpo_trl.run_logs`).
GRAD_NORM_SPIKE = "grad_norm/spike"


def evaluation_name(name: str) -> str:
    """The name TRL logs a metric under in an evaluation."""
    return EVAL_PREFIX + name
