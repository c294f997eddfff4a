"""Checkpoints: orbax directories of named items, written by every host in parallel.

A checkpoint is one directory holding these orbax items:

    params      the model parameters (always)
    opt_state   the rest of the train state: optimizer state, step, skipped-update
                counters (optional: --checkpointer.save_optimizer_state)
    data        the data pipeline's JSON state (`get_state_dict()`), for exact resume
    metadata    JSON: the flags, the model config, library versions

and a file `checksums.json`: one uint32 per array of params/opt_state, checked on
every restore (tensorstore notices a truncated file, not a flipped bit). It is
computed on the devices when a save starts and written once the save is
complete, so it never delays the loop; a checkpoint without it (the process died
in between) loads unverified. A restore into another dtype (an fp32 checkpoint
served in bf16) verifies the arrays as stored, then casts them.

The training loop's checkpoints are `<run dir>/checkpoints/<step>/`, each such a
directory; `save_params` writes one directly (a parameter-only export). Writes
go to a temporary directory renamed on completion, so a half-written checkpoint
is never taken for a complete one. A local disk without room for a save is a
UserError saying how much it needs, raised before writing where the free space
tells, else once the failed write is seen; what the save wrote is removed.
Nothing here unpickles: arrays are tensorstore/OCDBT, the rest JSON.

Load specs (`--load_checkpoint`), as in EasyLM:

    params::DIR             parameters only (a fresh optimizer)
    trainstate::DIR         everything, to resume (the trainer handles it)
    trainstate_params::DIR  the parameters out of a full train state

The trainer and the server also take `hf::DIR`, a Hugging Face directory
converted as it loads; the model family supplies that loader.
"""

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.runtime.dtypes import DTYPES, cast_names
from easylm.runtime.sharding import axes_size, path_to_string, spec_axes

LOAD_PREFIXES = ("params", "trainstate", "trainstate_params")
ITEMS = ("params", "opt_state", "data", "metadata")
CHECKSUMS = "checksums.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a save in progress
# Room for what is not array data: orbax's metadata files, about 12 KiB per array (6 on
# a tmpfs, 11 on ext4, measured with the debug model), and the JSON items.
_BYTES_PER_ARRAY = 12 << 10
_OVERHEAD_BYTES = 64 << 10
FLOAT_DTYPES = cast_names(DTYPES, keep="")

HELP = {
    "keep": "how many of the latest --save_model_freq checkpoints to keep (milestones "
            "and the final one are kept regardless)",
    "save_optimizer_state": "save the optimizer state too (needed for an exact resume)",
    "float_dtype": "cast parameters to this dtype (bf16, fp16, fp32) in checkpoints "
                   "without optimizer state; empty: keep their dtype",
    "checksums": "also write checksums.json (computed on the devices, one pass over the "
                 "state: free on GPU/TPU, about 1.3 s per GB on a 2-core CPU); restores "
                 "verify it whenever present",
    "ocdbt": "write arrays into a few OCDBT files per process instead of one file per "
             "array chunk: use it for multi-host runs and buckets (far fewer files); "
             "slower on a local disk with few cores (0.4x dd here, against 0.9x)",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.keep = 2
    config.save_optimizer_state = True
    config.float_dtype = ""
    config.checksums = True
    config.ocdbt = False
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def _item_handlers(for_saving: bool = False, ocdbt: bool = False) -> dict:
    # Arrays are written uncompressed: zstd gains ~8% on float weights and costs
    # more CPU time than the write itself (and, while writing, a second copy of the
    # state in its buffers). Reading handles every layout.
    if for_saving:
        arrays = lambda: ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=ocdbt)
    else:
        arrays = ocp.StandardCheckpointHandler
    return dict(params=arrays(), opt_state=arrays(),
                data=ocp.JsonCheckpointHandler(), metadata=ocp.JsonCheckpointHandler())


def _handler(for_saving: bool = False):
    return ocp.CompositeCheckpointHandler(**_item_handlers(for_saving))


def absolute_path(path: str) -> str:
    """Absolute local paths; URLs (gs://...) as given. orbax writes to either."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _is_dir(path: str) -> bool:
    return epath.Path(path).is_dir()


def parse_load_spec(spec: str, prefixes: tuple[str, ...] = LOAD_PREFIXES) -> tuple[str, str]:
    """'params::DIR' -> ('params', absolute DIR); `prefixes` are those the caller can load."""
    prefix, sep, path = spec.partition("::")
    if not sep or not path:
        raise UserError(
            f"--load_checkpoint={spec!r}: expected PREFIX::PATH with PREFIX one of "
            f"{', '.join(prefixes)}"
        )
    if prefix not in prefixes:
        raise UserError(
            f"--load_checkpoint={spec!r}: unknown prefix {prefix!r}; expected one of "
            f"{', '.join(prefixes)}"
        )
    return prefix, absolute_path(path)


def cast_floats(tree, dtype_name: str):
    """Cast floating-point leaves to `--checkpointer.float_dtype` ('' keeps them)."""
    if dtype_name not in FLOAT_DTYPES:
        raise UserError(
            f"--checkpointer.float_dtype={dtype_name!r} is not one of "
            f"{', '.join(repr(k) for k in FLOAT_DTYPES)}"
        )
    dtype = FLOAT_DTYPES[dtype_name]
    if dtype is None:
        return tree
    # jit keeps each leaf's sharding, so the cast happens shard by shard.
    return jax.jit(lambda t: jax.tree.map(
        lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, t
    ))(tree)


def _block_fingerprint(block, starts, shape):
    """sum(raw bits * odd weight of the global flat index) mod 2^32 over a block whose
    first element sits at `starts` in an array of `shape`. Any one flipped bit, or a
    swap of two elements, changes it; blocks add up to the whole array's value."""
    if jnp.issubdtype(block.dtype, jnp.integer) and jnp.iinfo(block.dtype).bits < 8:
        block = block.astype(jnp.uint8)  # int4/uint4 (an nf4 base): no bitcast to a byte
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[block.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(block, unsigned).astype(jnp.uint32)
    flat = jnp.zeros(block.shape, jnp.uint32)
    for dim, (start, size) in enumerate(zip(starts, shape)):
        index = jax.lax.broadcasted_iota(jnp.uint32, block.shape, dim) + jnp.uint32(start)
        flat = flat * jnp.uint32(size) + index
    return jnp.sum(bits * (flat * jnp.uint32(2654435761) | 1), dtype=jnp.uint32)


def _partial_fingerprints(x, sharding):
    """Per-device partial fingerprints, shaped like the mesh, computed without any
    collective: XLA:CPU can deadlock when a collective program runs alongside the
    train step, and nothing needs gathering."""
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec)) \
        if isinstance(sharding, jax.sharding.NamedSharding) else None
    if spec is None or any(size % axes_size(sharding.mesh.shape, axes) for size, axes in zip(x.shape, spec)):
        return _block_fingerprint(x, (0,) * x.ndim, x.shape)[None]  # unsharded (or uneven)
    mesh = sharding.mesh

    def local(block):
        starts, used = [], set()
        for dim, axes in enumerate(spec):
            position = 0
            for axis in spec_axes(axes):
                position = position * mesh.shape[axis] + jax.lax.axis_index(axis)
                used.add(axis)
            starts.append(position * block.shape[dim])
        # A block replicated over some mesh axes counts once, on their index 0.
        first_copy = jnp.uint32(1)
        for axis in mesh.axis_names:
            if axis not in used:
                first_copy = first_copy * (jax.lax.axis_index(axis) == 0).astype(jnp.uint32)
        value = _block_fingerprint(block, starts, x.shape) * first_copy
        return value.reshape((1,) * len(mesh.axis_names))

    return jax.shard_map(local, mesh=mesh, in_specs=jax.sharding.PartitionSpec(*spec),
                         out_specs=jax.sharding.PartitionSpec(*mesh.axis_names),
                         check_vma=False)(x)


@functools.partial(jax.jit, static_argnums=1)
def _partial_fingerprints_flat(leaves, shardings):
    return [_partial_fingerprints(x, s) for x, s in zip(leaves, shardings)]


def partial_fingerprints(tree):
    """`_partial_fingerprints` of every jax.Array leaf, in one program dispatched
    asynchronously like a train step (the shardings, needed to split the work, are
    static); numpy leaves (a converter's weights) are fingerprinted on the host in
    chunks, never copied whole to a device."""
    leaves, treedef = jax.tree.flatten(tree)
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    out = [None] * len(leaves)
    device_out = _partial_fingerprints_flat([leaves[i] for i in on_device],
                                            tuple(leaves[i].sharding for i in on_device))
    for i, value in zip(on_device, device_out):
        out[i] = value
    for i, x in enumerate(leaves):
        if out[i] is None:
            out[i] = np.array([_host_fingerprint(np.asarray(x))], np.uint32)
    return treedef.unflatten(out)


def _host_fingerprint(x: np.ndarray, chunk: int = 1 << 24) -> int:
    """`_block_fingerprint` of a whole numpy array, in uint32 arithmetic like XLA's."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    bits = np.ascontiguousarray(x).reshape(-1).view(unsigned)
    total = 0
    for start in range(0, bits.size, chunk):
        part = bits[start:start + chunk].astype(np.uint32)
        index = np.arange(start, start + part.size, dtype=np.uint64).astype(np.uint32)
        weights = index * np.uint32(2654435761) | np.uint32(1)
        total += int(np.sum(part * weights, dtype=np.uint64))
    return total % 2**32


def _total(partials) -> int:
    return int(np.sum(np.asarray(partials, dtype=np.uint64)) % 2**32)


def _totals(partials) -> dict:
    """{item: {path: checksum}} from partial fingerprints (waits for them)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        partials = jax.tree.map(
            lambda p: multihost_utils.process_allgather(p, tiled=True)
            if isinstance(p, jax.Array) and not p.is_fully_addressable else p, partials)
    partials = jax.device_get(partials)
    return {item: {name: _total(p) for name, p in _by_path(tree).items()}
            for item, tree in partials.items()}


def fingerprint(tree) -> str:
    """One digest of the checksums of every array in `tree` (computed on the devices; waits
    for them): what identifies a run's frozen base."""
    import hashlib

    sums = _totals({"tree": partial_fingerprints(tree)})["tree"]
    return hashlib.sha1(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def _write_checksums(directory: str, partials):
    totals = _totals(partials)
    if jax.process_index() == 0 and _is_dir(directory):
        tmp = epath.Path(directory) / (CHECKSUMS + ".tmp")
        tmp.write_text(json.dumps(totals))
        tmp.rename(epath.Path(directory) / CHECKSUMS)


def _save_args(params, opt_state, data_state, metadata) -> ocp.args.Composite:
    items = {"params": ocp.args.PyTreeSave(params)}
    if opt_state is not None:
        items["opt_state"] = ocp.args.PyTreeSave(opt_state)
    if data_state is not None:
        items["data"] = ocp.args.JsonSave(data_state)
    items["metadata"] = ocp.args.JsonSave(metadata)
    return ocp.args.Composite(**items)


def save_params(directory: str, params, metadata: dict, float_dtype: str = "") -> str:
    """Write a parameter-only checkpoint (params + metadata) to `directory`; blocks.

    `directory` must not exist yet: an existing checkpoint is never overwritten.
    Load it back with `load_params('params::' + directory, abstract_params)`. A disk
    that is (or gets) too small is a UserError, and nothing of the save is left.
    """
    directory = absolute_path(directory)
    if epath.Path(directory).exists():
        raise UserError(f"{directory} already exists; refusing to overwrite it")
    params = cast_floats(params, float_dtype)
    needed = check_free_space(directory, _nbytes(params), "the checkpoint",
                              len(jax.tree.leaves(params)))
    try:
        with ocp.Checkpointer(_handler(for_saving=True)) as checkpointer:
            checkpointer.save(directory, _save_args(params, None, None, metadata))
        # One small program per array: a single program over the whole tree would hold
        # temporaries for every array at once (a converter's peak memory).
        _write_checksums(directory, {"params": jax.tree.map(partial_fingerprints, params)})
    except Exception as e:
        if not is_disk_full(e):
            raise
        _remove(directory)
        _remove(directory + TMP_SUFFIX)
        raise disk_full_error("the checkpoint", directory, needed) from None
    return directory


# ------------------------------------------------------------------ disk full


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, is ENOSPC (tensorstore reports it as
    a RESOURCE_EXHAUSTED ValueError that quotes the OS error)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _free_bytes(directory: str) -> int | None:
    """Free bytes of the local file system `directory` is (or would be) on."""
    if "://" in directory:
        return None  # a bucket: no such number
    path = directory
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return shutil.disk_usage(path).free


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def check_free_space(directory: str, array_bytes: int, what: str, arrays: int = 1) -> int:
    """A UserError before writing `what` (`arrays` arrays of `array_bytes` in all) to a
    local disk without room for it; returns about how many bytes it needs."""
    needed = array_bytes + arrays * _BYTES_PER_ARRAY + _OVERHEAD_BYTES
    free = _free_bytes(directory)
    if free is not None and free < needed:
        raise UserError(f"not enough disk space for {what} at {directory}: it needs about "
                        f"{_size(needed)}, {_size(free)} are free")
    return needed


def disk_full_error(what: str, directory: str, needed: int, note: str = "") -> UserError:
    _disk_was_full.set()
    free = _free_bytes(directory)
    now = "" if free is None else f", {_size(free)} free now"
    return UserError(f"disk full while writing {what} to {directory}: about {_size(needed)} "
                     f"needed{now}; what it had written is removed{note}")


def _remove(path: str):
    if epath.Path(path).exists():
        epath.Path(path).rmtree()


class _DropDiskFullLogs(logging.Filter):
    """orbax's save threads and tasks each log the same ENOSPC with a traceback; the
    caller of the save reports it once, as a UserError."""

    def filter(self, record):
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        return not (is_disk_full(error) or "No space left on device" in message
                    or "os_error_code='28'" in message)


for _name in ("absl", "asyncio"):
    logging.getLogger(_name).addFilter(_DropDiskFullLogs())
_disk_was_full = threading.Event()


def _drop_save_noise(hook):
    """A failed save's writers, still running, call back into its closed event loop
    and get garbage-collected half done (also at interpreter exit): Python reports each
    as an unraisable error, pages of tracebacks about the error already reported."""

    def filtered(unraisable):
        error = unraisable.exc_value
        if _disk_was_full.is_set() or is_disk_full(error) or (
                isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            return
        hook(unraisable)

    return filtered


sys.unraisablehook = _drop_save_noise(sys.unraisablehook)


def check_checkpoint_dir(directory: str, items=("params",)) -> None:
    """A clear error unless `directory` is a complete checkpoint with `items`."""
    if not _is_dir(directory):
        raise UserError(f"no checkpoint at {directory}: the directory does not exist")
    if ocp.utils.is_tmp_checkpoint(directory) or not ocp.utils.is_checkpoint_finalized(directory):
        raise UserError(
            f"{directory} is an unfinished checkpoint (its save never completed); "
            f"use an earlier one"
        )
    for item in items:
        if not has_item(directory, item):
            present = sorted(i for i in ITEMS if has_item(directory, i))
            raise UserError(
                f"no checkpoint at {directory}: it has no {item!r} item "
                f"(found: {', '.join(present) or 'nothing orbax wrote'})"
            )


def has_item(directory: str, item: str) -> bool:
    return _is_dir(os.path.join(directory, item))


def stored_tree(directory: str, item: str):
    """The checkpoint's tree of ArrayMetadata (shape, dtype) for `item`."""
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns before we can explain
    try:
        with ocp.Checkpointer(_handler()) as checkpointer:
            metadata = checkpointer.metadata(directory).item_metadata[item]
    except Exception as e:  # orbax raises many kinds for unreadable files
        raise _unreadable(directory, e) from None
    finally:
        absl_logging.set_verbosity(verbosity)
    if metadata is None:
        raise UserError(f"cannot read the {item!r} metadata of the checkpoint at {directory} "
                        f"(corrupted or truncated?)")
    return metadata.tree


def _unreadable(directory: str, error: Exception) -> UserError:
    first_line = (str(error).strip().splitlines() or [""])[0]
    first_line = first_line.split(" See full TensorStore details")[0][:300]
    return UserError(
        f"cannot read the checkpoint at {directory} (corrupted or truncated?): "
        f"{type(error).__name__}: {first_line}"
    )


def check_shapes(stored, abstract, directory: str, item: str = "params") -> None:
    """Compare names and shapes; name the first difference and both shapes."""
    stored_leaves, wanted = _by_path(stored), _by_path(abstract)
    missing = [name for name in wanted if name not in stored_leaves]
    if missing:
        raise UserError(
            f"checkpoint {directory} has no {item} entry {missing[0]!r} that the configured "
            f"model needs ({len(missing)} missing)"
        )
    unexpected = [name for name in stored_leaves if name not in wanted]
    if unexpected:
        raise UserError(
            f"checkpoint {directory} has {item} entry {unexpected[0]!r} that the configured "
            f"model does not have ({len(unexpected)} unexpected)"
        )
    for name, leaf in wanted.items():
        stored_shape = tuple(stored_leaves[name].shape)
        if stored_shape != tuple(leaf.shape):
            raise UserError(
                f"checkpoint {directory}: {item} entry {name!r} has shape {stored_shape} "
                f"but the configured model expects {tuple(leaf.shape)}"
            )


def _with_sharding(tree):
    """Leaves given without a sharding are restored onto the first device."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda x: x if getattr(x, "sharding", None) is not None
        else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def restore_items(directory: str, abstract: dict, json_items=()) -> dict:
    """Restore array items (checked against `abstract`, resharded to its shardings and
    cast to its dtypes, verified against their checksums) and JSON items from a
    complete checkpoint."""
    check_checkpoint_dir(directory, tuple(abstract) + tuple(json_items))
    stored = {item: stored_tree(directory, item) for item in abstract}
    for item, tree in abstract.items():
        check_shapes(stored[item], tree, directory, item)
    checksums = _read_checksums(directory) if abstract else None
    # A checksum is of the stored bits: verified arrays are restored as stored and cast
    # after (on the devices, so the stored dtype's copy is there until then); unverified
    # ones are cast by orbax as they are read.
    targets = abstract if checksums is None else {
        item: _as_stored(tree, stored[item]) for item, tree in abstract.items()}
    args = {item: ocp.args.StandardRestore(_with_sharding(tree)) for item, tree in targets.items()}
    args.update({item: ocp.args.JsonRestore() for item in json_items})
    try:
        with ocp.Checkpointer(_handler()) as checkpointer:
            restored = dict(checkpointer.restore(directory, ocp.args.Composite(**args)))
    except Exception as e:
        raise _unreadable(directory, e) from None
    if checksums is not None:
        for item in abstract:
            _verify(directory, item, restored[item], checksums.get(item, {}))
            restored[item] = _cast_like(restored[item], abstract[item])
    return restored


def _as_stored(abstract, stored):
    """`abstract` with the stored dtypes."""
    dtypes = {name: m.dtype for name, m in _by_path(stored).items()}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, dtypes[path_to_string(p)],
                                          sharding=getattr(x, "sharding", None)), abstract)


@functools.lru_cache(maxsize=None)
def _cast_to(dtype, sharding):
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)


def _cast_like(tree, abstract):
    """Each leaf of `tree` cast to `abstract`'s dtype, in its shards; a cast leaf's
    original is freed at once, so two copies of the whole tree never coexist."""
    def cast(x, target):
        if x.dtype == target.dtype:
            return x
        y = _cast_to(jnp.dtype(target.dtype), x.sharding)(x)
        x.delete()
        return y

    return jax.tree.map(cast, tree, abstract)


def _read_checksums(directory: str) -> dict | None:
    path = epath.Path(directory) / CHECKSUMS
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"checkpoint {directory} is corrupted: {CHECKSUMS} is not valid "
                        f"JSON ({e})") from None


def _by_path(tree) -> dict:
    """{'a/b/0/c': leaf}: stored trees come back with lists where ours have tuples."""
    return {path_to_string(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _verify(directory: str, item: str, tree, expected: dict):
    """`tree` (restored in its stored dtypes) against the checksums saved with it."""
    actual = _totals({item: partial_fingerprints(tree)})[item]
    for name, want in expected.items():
        if actual.get(name) != want:
            raise UserError(
                f"checkpoint {directory} is corrupted: {item} entry {name!r} "
                f"does not match the checksum saved with it"
            )


def load_params(spec: str, abstract_params):
    """Parameters from a load spec, placed as `abstract_params` says.

    `abstract_params` is a pytree of `jax.ShapeDtypeStruct` with `sharding=` set;
    the stored arrays are resharded and cast to it, whatever mesh or dtype they
    were saved with. Every prefix reads the `params` item.
    """
    _, directory = parse_load_spec(spec)
    return restore_items(directory, {"params": abstract_params})["params"]


def load_stored_params(spec: str):
    """The parameters of an easylm checkpoint on one device, as they were stored (their
    layout and dtypes): what converters and adapter readers take."""
    _, directory = parse_load_spec(spec)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=device),
        stored_tree(directory, "params"))
    return load_params(spec, abstract)


def read_metadata(directory: str) -> dict:
    """The checkpoint's metadata JSON (flags, model config, versions)."""
    return restore_items(directory, {}, json_items=("metadata",))["metadata"]


class CheckpointManager:
    """The training loop's checkpoints, `DIRECTORY/<step>/`, saved asynchronously.

    `save` returns once the arrays are copied off the devices; the write and
    the atomic rename finish in the background. Kept: the latest
    `--checkpointer.keep`, every multiple of `milestone_freq`, and (being the
    latest) the final one. A disk without room for a checkpoint is a UserError
    (before the save when it can be told, else when the failed save is next
    looked at), and the failed save's temporary directory is removed.
    """

    def __init__(self, directory: str, config: ConfigDict, milestone_freq: int = 0):
        if config.keep < 1:
            raise UserError(f"--checkpointer.keep must be >= 1, got {config.keep}")
        cast_floats({}, config.float_dtype)  # validates the name early
        self.directory = absolute_path(directory)
        self.config = config
        policies = [ocp.checkpoint_managers.LatestN(config.keep)]
        if milestone_freq > 0:
            policies.append(ocp.checkpoint_managers.EveryNSteps(milestone_freq))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            ),
            item_handlers=_item_handlers(for_saving=True, ocdbt=config.ocdbt),
        )
        self._pending = None  # (step, checksums still being computed)
        self._saving = None  # (step, bytes) of the save last started
        self._disk_was_full = False

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step; unfinished saves are never listed."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def step_directory(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def remove_unfinished(self) -> list[str]:
        """Delete the temporary directories of saves that never completed (a crash, a
        full disk); returns their names. Only for the run's one writer (the trainer
        holding the run directory's lock): for anyone else they may be in progress."""
        if jax.process_index() != 0 or not _is_dir(self.directory):
            return []
        removed = []
        for path in sorted(epath.Path(self.directory).iterdir()):
            if TMP_SUFFIX in path.name:
                path.rmtree()
                removed.append(path.name)
        return removed

    def save(self, step: int, params, opt_state, data_state: dict, metadata: dict):
        """Start an asynchronous save; `opt_state` is the train state minus params."""
        self._write_pending_checksums()
        if not self.config.save_optimizer_state:
            params, opt_state = cast_floats(params, self.config.float_dtype), None
        arrays = {"params": params} if opt_state is None else {"params": params, "opt_state": opt_state}
        try:
            needed = check_free_space(self.step_directory(step), _nbytes(arrays),
                                      f"the checkpoint of step {step}", len(jax.tree.leaves(arrays)))
        except UserError as e:
            raise UserError(f"{e}{self._intact()}") from None
        with self._reporting_disk_full():
            self._saving = (step, needed)
            self._manager.save(step, args=_save_args(params, opt_state, data_state, metadata),
                               force=True)
        if self.config.checksums:
            self._pending = (step, partial_fingerprints(arrays))  # runs on the devices meanwhile

    def _intact(self) -> str:
        latest = self.latest_step()
        return "" if latest is None else f"; the earlier checkpoints are intact (latest: step {latest})"

    @contextlib.contextmanager
    def _reporting_disk_full(self):
        """A full disk during the save last started (orbax raises its errors at the next
        call) becomes a UserError; `close` removes the failed save's directory."""
        try:
            yield
        except Exception as e:
            if not is_disk_full(e) or self._saving is None:
                raise
            if self._disk_was_full:
                return  # orbax raising again what was reported
            self._disk_was_full = True
            step, needed = self._saving
            self._pending = None
            raise disk_full_error(f"the checkpoint of step {step}", self.step_directory(step),
                                   needed, self._intact()) from None

    def _write_pending_checksums(self):
        if self._pending is not None:
            step, partials = self._pending
            self._pending = None
            with self._reporting_disk_full():
                self._manager.wait_until_finished()  # the step directory is final now
                _write_checksums(self.step_directory(step), partials)

    def wait(self):
        with self._reporting_disk_full():
            self._manager.wait_until_finished()
        self._write_pending_checksums()

    def close(self):
        """Waits for the save in flight; removes what a save that filled the disk wrote."""
        with self._reporting_disk_full():
            self._manager.close()
        if self._disk_was_full:
            # Writes tensorstore had started when the save failed still land for a few
            # milliseconds after orbax gives up on them.
            for attempt in range(20):
                paths = list(epath.Path(self.directory).glob(f"{self._saving[0]}{TMP_SUFFIX}*"))
                if not paths:
                    break
                for path in paths:
                    shutil.rmtree(path, ignore_errors=True)
                time.sleep(0.05 * attempt)
