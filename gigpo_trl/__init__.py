"""gigpo-trl: GiGPO (Group-in-Group Policy Optimization) for multi-turn LLM agents on Hugging Face TRL."""

from gigpo_trl.advantages import GiGPOAdvantages, StepGroupStats, compute_gigpo_advantages

__version__ = "0.1.0"
__all__ = ["GiGPOAdvantages", "StepGroupStats", "compute_gigpo_advantages"]
