"""Environments shipped with gigpo-trl (installed as `gigpo_trl.environments`)."""
