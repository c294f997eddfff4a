"""Rematerialisation policies by flag name: the one table a family's `remat_policy`
field, its model and the planner read.

Ordered by how much the backward pass recomputes, least first: the planner tries
them in this order when a run does not fit.
"""

import jax

POLICIES = {
    "none": None,  # no remat: every activation the backward pass needs is kept
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "checkpoint_dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # Keep each layer's attention output (named `attention_out` in the model); recompute
    # the rest.
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
NAMES = tuple(POLICIES)
