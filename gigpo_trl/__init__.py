"""gigpo-trl: GiGPO (Group-in-Group Policy Optimization) for multi-turn LLM agents on Hugging Face TRL.

`import gigpo_trl` is light; the trainer (and TRL) load on first use of `GiGPOConfig` / `GiGPOTrainer`.
"""

from importlib import import_module
from typing import Any

from gigpo_trl.advantages import GiGPOAdvantages, StepGroupStats, compute_gigpo_advantages
from gigpo_trl.env_checker import EnvCheckError, EnvCheckWarning, check_env
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.envs import fold_seeds, make_env, register_env, registered_envs
from gigpo_trl.models import EMBEDDED_MODEL
from gigpo_trl.tasks import Task, TaskArguments, task_dataset

__version__ = "0.1.0"
__all__ = [
    "EMBEDDED_MODEL", "EnvCheckError", "EnvCheckWarning", "EnvPool", "GiGPOAdvantages", "GiGPOConfig", "GiGPOTrainer", "StepGroupStats",
    "Task", "TaskArguments", "check_env", "compute_gigpo_advantages", "fold_seeds", "make_env", "register_env",
    "registered_envs", "task_dataset",
]

_LAZY = {"GiGPOConfig": "gigpo_trl.config", "GiGPOTrainer": "gigpo_trl.trainer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gigpo_trl' has no attribute {name!r}")
