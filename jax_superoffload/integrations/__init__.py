"""Entries into the trainers people run, each importing its trainer alone.

`jax_superoffload.integrations.maxtext`: MaxText's pre-train loop with
`superoffload.adamw` in place of its `optax.adamw`
(`pip install jax_superoffload[maxtext]`).
"""
