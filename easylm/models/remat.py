"""Rematerialisation policies by flag name: the one table a family's `remat_policy`
field, its model and the planner read.

Ordered by how much the backward pass recomputes, least first: the planner tries
them in this order when a run does not fit.

Names are the outputs the decoder tags with `checkpoint_name`: each projection's by its
parameter name (`decoder.NamedDense`: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj) and `attention_out`, attention's output before o_proj.
"""

import jax

# The attention block's projections and attention's output: (B, T, <= 2 N H) each, about
# a third of what a layer keeps without remat; the MLP's (B, T, F) gate, up and product,
# the largest, are recomputed. MaxText's `save_dot_except_mlp`.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "attention_out", "o_proj")

POLICIES = {
    "none": None,  # no remat: every activation the backward pass needs is kept
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "checkpoint_dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_attention_projections": jax.checkpoint_policies.save_only_these_names(
        *ATTENTION_PROJECTIONS),
    # Keep each layer's attention output (named `attention_out` in the model); recompute
    # the rest.
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
    # The same outputs copied to the host's pinned memory after the forward pass and back
    # for the backward: nothing of a layer stays on the device, less is recomputed than
    # with nothing_saveable, at the cost of the transfers.
    "offload_attention_projections": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(ATTENTION_PROJECTIONS),
        offload_src="device", offload_dst="pinned_host"),
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
NAMES = tuple(POLICIES)
