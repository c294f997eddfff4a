"""The device mesh, parameter partition rules, and activation constraints.

Parameters are sharded by a model's table of `(regex, PartitionSpec)` rules,
matched in order against each parameter's path (`model/layers/0/self_attn/
q_proj/kernel`). A parameter that matches no rule is an error, never a silent
replicate. Activations are constrained in a few places only, through
`constrain`, which is a no-op when no mesh is set (single-device use).

Mesh axes (every mesh has all five; the ones not asked for have size 1):
    dp    data parallel: parameters replicated, batch split
    fsdp  fully sharded data parallel: parameters and batch split
    sp    sequence (context) parallel: the sequence split, attention over it by
          models/context_parallel.py (--context_parallel=ring|all_gather); parameters
          split over it with fsdp (`PARAMETER_AXES`)
    ep    expert parallel: experts of a mixture-of-experts layer split; for every other
          parameter a data-parallel axis (batch split, parameters replicated)
    mp    model (tensor) parallel: heads and hidden features split

`--mesh_dim` is EasyLM's three bare numbers dp,fsdp,mp (`1,-1,1`) or named sizes
(`dp=1,fsdp=2,ep=4`, axes not named are 1); one size may be -1 (all remaining devices).
"""

import math
import re
from typing import Callable, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from easylm.errors import UserError

MESH_AXES = ("dp", "fsdp", "sp", "ep", "mp")  # mp innermost: nearest devices talk most
POSITIONAL_AXES = ("dp", "fsdp", "mp")  # what EasyLM's three bare numbers mean
BATCH_AXES = ("dp", "fsdp", "ep")  # the batch dimension is split over all three

# What 'fsdp' in a partition rule table splits: fsdp and the sequence axis together, as
# MaxText does, so that sp saves parameter and optimizer memory as well as activations.
# Each layer's weights are gathered over both before use, as over fsdp alone (their
# gradients reduce-scattered over both), so the sp devices, which hold different places
# of the same rows, still see whole weights.
PARAMETER_AXES = ("fsdp", "sp")

PartitionRules = Sequence[tuple[str, P]]


def parse_mesh_dim(mesh_dim: str, num_devices: int, flag: str = "mesh_dim",
                   unit: str = "devices") -> dict[str, int]:
    """'dp,fsdp,mp' or 'dp=1,fsdp=2,ep=4' -> {axis: size} over MESH_AXES whose product
    is num_devices; one size may be -1.

    `flag` and `unit` name what is being split in error messages (`dcn_mesh_dim`
    splits processes or slices, not devices).
    """
    entries = str(mesh_dim).split(",")
    if any("=" in e for e in entries):
        sizes = _named_sizes(mesh_dim, entries, flag)
    else:
        try:
            dims = [int(d) for d in entries]
        except ValueError:
            raise UserError(f"--{flag}={mesh_dim!r} must be comma-separated integers like "
                            f"'1,-1,1' or named sizes like 'dp=1,fsdp=2,ep=4'")
        if len(dims) != len(POSITIONAL_AXES):
            raise UserError(
                f"--{flag}={mesh_dim!r} has {len(dims)} entries; expected "
                f"{len(POSITIONAL_AXES)} ({','.join(POSITIONAL_AXES)}) or named sizes like "
                f"'dp=1,fsdp=2,ep=4' (axes {','.join(MESH_AXES)})"
            )
        sizes = dict(zip(POSITIONAL_AXES, dims))
    sizes = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
    dims = list(sizes.values())
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise UserError(f"--{flag}={mesh_dim!r}: entries must be >= 1, with at most one -1")
    known = math.prod(d for d in dims if d != -1)
    if -1 in dims:
        if num_devices % known:
            raise UserError(
                f"--{flag}={mesh_dim!r}: the product of the given entries, {known}, "
                f"does not divide the {num_devices} {unit}"
            )
        sizes[MESH_AXES[dims.index(-1)]] = num_devices // known
    elif known != num_devices:
        raise UserError(
            f"--{flag}={mesh_dim!r}: the product {known} does not match the "
            f"{num_devices} {unit}"
        )
    return sizes


def _named_sizes(mesh_dim: str, entries: list[str], flag: str) -> dict[str, int]:
    sizes = {}
    for entry in entries:
        axis, eq, size = entry.partition("=")
        axis = axis.strip()
        if not eq:
            raise UserError(f"--{flag}={mesh_dim!r}: {entry!r} has no '='; write every "
                            f"entry as axis=size or give three bare numbers dp,fsdp,mp")
        if axis not in MESH_AXES:
            raise UserError(f"--{flag}={mesh_dim!r}: unknown axis {axis!r}; the axes are "
                            f"{','.join(MESH_AXES)}")
        if axis in sizes:
            raise UserError(f"--{flag}={mesh_dim!r}: axis {axis!r} is given twice")
        try:
            sizes[axis] = int(size)
        except ValueError:
            raise UserError(f"--{flag}={mesh_dim!r}: the size of {axis!r} must be an integer")
    return sizes


def mesh_dim_string(sizes: dict[str, int]) -> str:
    """A --mesh_dim value for {axis: size}: EasyLM's three numbers where they suffice."""
    if all(sizes.get(axis, 1) == 1 for axis in MESH_AXES if axis not in POSITIONAL_AXES):
        return ",".join(str(sizes.get(axis, 1)) for axis in POSITIONAL_AXES)
    return ",".join(f"{axis}={sizes[axis]}" for axis in MESH_AXES if sizes.get(axis, 1) > 1)


def hybrid_mesh_shape(mesh_dim: str, dcn_mesh_dim: str, num_devices: int, num_granules: int,
                      granule: str = "process") -> tuple[dict[str, int], dict[str, int]]:
    """(ici, dcn) {axis: size}: `dcn_mesh_dim` splits the granules (processes, or TPU
    slices), `mesh_dim` the devices of one granule; the mesh is their product per axis."""
    granules = {"process": "processes", "slice": "slices"}[granule]
    if num_devices % num_granules:
        raise UserError(f"{num_devices} devices cannot be split evenly over {num_granules} "
                        f"{granules}")
    dcn = parse_mesh_dim(dcn_mesh_dim, num_granules, "dcn_mesh_dim", granules)
    ici = parse_mesh_dim(mesh_dim, num_devices // num_granules, "mesh_dim",
                         f"devices per {granule} (--dcn_mesh_dim is set)")
    return ici, dcn


def make_mesh(mesh_dim: str = "1,-1,1", devices: Sequence[jax.Device] | None = None,
              dcn_mesh_dim: str = "") -> Mesh:
    """A (dp, fsdp, sp, ep, mp) mesh over `devices` (all devices by default).

    Without `dcn_mesh_dim`, `mesh_dim` splits all devices. With it (Paxml's
    hybrid mesh), `mesh_dim` splits the devices inside one TPU slice, or one
    process on GPU/CPU, which talk over the fast interconnect (ICI/NVLink), and
    `dcn_mesh_dim` how the slices/processes are combined over the data-center
    network: `--dcn_mesh_dim=2,1,1 --mesh_dim=1,-1,1` is data parallel across
    two slices and fsdp inside each, so only gradients cross the slow network.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not dcn_mesh_dim:
        shape = tuple(parse_mesh_dim(mesh_dim, len(devices)).values())
        device_array = mesh_utils.create_device_mesh(shape, devices=devices)
    else:
        # TPU devices know their slice; elsewhere each process (host) is a granule.
        by_slice = devices[0].platform == "tpu" and hasattr(devices[0], "slice_index")
        granules = {d.slice_index if by_slice else d.process_index for d in devices}
        ici, dcn = hybrid_mesh_shape(mesh_dim, dcn_mesh_dim, len(devices), len(granules),
                                     "slice" if by_slice else "process")
        device_array = mesh_utils.create_hybrid_device_mesh(
            tuple(ici.values()), tuple(dcn.values()), devices=devices,
            process_is_granule=not by_slice)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def shown_axes(shape) -> dict[str, int]:
    """{axis: size} of a Mesh or its shape as every command reports it: dp, fsdp and mp
    always, sp and ep only where they split something."""
    shape = getattr(shape, "shape", shape)
    return {axis: size for axis, size in shape.items() if axis in POSITIONAL_AXES or size > 1}


def mesh_string(shape) -> str:
    """'dp=1 fsdp=8 mp=1' for a Mesh or its {axis: size} shape, as every command prints it."""
    return " ".join(f"{axis}={size}" for axis, size in shown_axes(shape).items())


def path_to_string(path) -> str:
    """A jax tree path as 'a/b/0/c'."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def match_partition_rules(rules: PartitionRules, tree):
    """A PartitionSpec for every leaf of `tree` (arrays or ShapeDtypeStructs).

    Rules are tried in order with `re.search` on the leaf's path. Scalars and
    single-element leaves (step counters) are replicated. A rule written for an
    unscanned parameter also fits its scanned form, whose extra leading axis
    (the layer index) is left unsharded.
    """

    def spec_for(path, leaf):
        name = path_to_string(path)
        shape = np.shape(leaf)
        if len(shape) == 0 or math.prod(shape) == 1:
            return P()
        for pattern, spec in rules:
            if re.search(pattern, name) is None:
                continue
            if len(spec) == len(shape) - 1:
                return P(None, *spec)
            if len(spec) > len(shape):
                raise UserError(
                    f"partition rule {pattern!r} gives {spec} to parameter {name!r} "
                    f"of shape {shape}, which has fewer dimensions"
                )
            return spec
        raise UserError(
            f"no partition rule matches parameter {name!r} (shape {shape}); "
            f"add a rule for it to the model's partition rule table"
        )

    return jax.tree_util.tree_map_with_path(spec_for, tree)


def over_parameter_axes(spec: P, mesh_shape) -> P:
    """A rule table's `spec` on a mesh of {axis: size}: every 'fsdp' as PARAMETER_AXES when
    the mesh splits the sequence (as written otherwise, so specs read as in the table)."""
    if mesh_shape.get("sp", 1) == 1:
        return spec

    def resolve(axes):
        return tuple(a for axis in spec_axes(axes)
                     for a in (PARAMETER_AXES if axis == "fsdp" else (axis,))) or None

    return P(*(resolve(axes) if "fsdp" in spec_axes(axes) else axes for axes in spec))


def named_shardings(mesh: Mesh, specs):
    """NamedShardings of rule-table specs on `mesh` ('fsdp' resolved by
    `over_parameter_axes`)."""
    return jax.tree_util.tree_map(
        lambda spec: NamedSharding(mesh, over_parameter_axes(spec, dict(mesh.shape))), specs,
        is_leaf=lambda x: isinstance(x, P)
    )


def rule_shardings(mesh: Mesh, rules: PartitionRules, shapes):
    """NamedShardings on `mesh` of the leaves of `shapes` (arrays or ShapeDtypeStructs) by
    the rule table `rules`, after checking that the mesh splits every dimension a rule
    splits: a UserError naming the parameter, its shape and the axis (not JAX's
    IndivisibleError traceback when the arrays are placed)."""
    specs = match_partition_rules(rules, shapes)
    mesh_shape = dict(mesh.shape)

    def check(path, leaf, spec):
        for axis, (dim, axes) in enumerate(zip(np.shape(leaf), over_parameter_axes(
                spec, mesh_shape))):
            ways = axes_size(mesh_shape, axes)
            if dim % ways:
                names = [a for a in spec_axes(axes) if mesh_shape[a] > 1]
                split = "*".join(f"{a}={mesh_shape[a]}" for a in names)
                raise UserError(
                    f"parameter {path_to_string(path)!r} of shape {np.shape(leaf)} cannot be "
                    f"split over {split} of the mesh on its axis {axis} ({dim} is not a "
                    f"multiple of {ways}): give a --mesh_dim whose {'*'.join(names)} "
                    f"divides {dim}")

    jax.tree_util.tree_map_with_path(check, shapes, specs)
    return named_shardings(mesh, specs)


def spec_axes(axes) -> tuple:
    """One entry of a PartitionSpec (an axis name, a tuple of them, or None) as a tuple."""
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def axes_size(mesh_shape, axes) -> int:
    """How many ways one PartitionSpec entry splits a dimension over a mesh's
    {axis: size}."""
    return math.prod(mesh_shape[a] for a in spec_axes(axes) if a is not None)


def batch_shards(mesh_shape) -> int:
    """How many ways the batch is split: dp*fsdp*ep of a mesh's {axis: size}."""
    return axes_size(mesh_shape, BATCH_AXES)


def check_batch_split(batch_size: int, mesh_shape, accumulate_steps: int = 1) -> None:
    """A UserError unless a global batch of `batch_size` rows splits over the mesh's
    dp*fsdp*ep batch shards and into `accumulate_steps` micro-batches."""
    shards = batch_shards(mesh_shape)
    axes = "*".join(a for a in BATCH_AXES if a in POSITIONAL_AXES or mesh_shape[a] > 1)
    if batch_size % (shards * accumulate_steps):
        raise UserError(
            f"--train_dataset batch size {batch_size} must be a multiple of the {axes}="
            f"{shards} batch shards times --optimizer.accumulate_gradient_steps="
            f"{accumulate_steps}")


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """`with_sharding_constraint` under the current mesh; nothing without one.

    Axes of `spec` that the mesh splits in a way the dimension cannot take
    (a batch of 1 over 8 devices in decoding) are left to XLA.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if any(dim % axes_size(mesh.shape, axes) for dim, axes in zip(x.shape, spec)):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def init_sharded(init_fn: Callable, rules: PartitionRules, mesh: Mesh, *args):
    """Run `init_fn(*args)` with its outputs created directly in their shards.

    The shapes come from `jax.eval_shape`, the specs from the rules, and the
    real initialisation runs under jit with those out_shardings, so no device
    ever holds the whole model.
    """
    shapes = jax.eval_shape(init_fn, *args)
    shardings = rule_shardings(mesh, rules, shapes)
    with jax.set_mesh(mesh):
        return jax.jit(init_fn, out_shardings=shardings)(*args)
