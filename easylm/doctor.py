"""Check a machine (or every host of a cluster) before training on it.

    python -m easylm.doctor [trainer flags]

Run it with the same flags (or `--flagfile`) as the training run, on every host
when there are several. It starts `jax.distributed` as the trainer would, then
prints the library versions, the backend and each process's devices, and checks:

    the mesh (`--mesh_dim`, `--dcn_mesh_dim`) divides the devices
    the batch splits over the processes and the mesh's batch shards
    the rows split over sp, the experts over ep, --context_parallel has an sp to use
    every process joined, and a sum over all devices sees all of them
    the compilation cache directory (if set) and `--logger.output_dir` are writable
    an image-text model's chats: the image processor is there, and the images of the
    first rows (IMAGE_ROWS) of --train_dataset.json_dataset.path read

Process 0 prints the report; every process prints its own problems, one line
each (`problem: ...`). Exit status: 0 healthy, 1 problems, 2 bad flags or a peer
that never connected (see `--jax_distributed.initialization_timeout`).
"""

import importlib.metadata
import os
import platform
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from easylm import flags as flag_lib, model_flags, objectives, variants
from easylm.data.options import loader_options
from easylm.errors import UserError, exit_on_user_error
from easylm.runtime import distributed
from easylm.runtime.sharding import check_batch_split, make_mesh, mesh_string
from easylm.training import options as trainer

IMAGE_ROWS = 16  # the image chats whose images the doctor reads
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers")
# Reported when installed: the accelerator plugins jax runs on.
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "libtpu",
           "libtpu-nightly")


def versions() -> str:
    found = {"python": platform.python_version()}
    for name in PACKAGES + PLUGINS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if name in PACKAGES:
                found[name] = "missing"
    backend = jax.extend.backend.get_backend()
    if backend.platform != "cpu":  # e.g. 'cuda 12080' or the libtpu build
        found[backend.platform] = backend.platform_version.strip()
    return " | ".join(f"{name} {version}" for name, version in found.items())


def _writable(directory: str) -> str | None:
    """None if a file can be created in `directory` (or, when it does not exist yet,
    its nearest existing parent); else why not."""
    if "://" in directory:
        return None  # buckets: the trainer's first save tells
    path = os.path.abspath(os.path.expanduser(directory))
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{path} is not writable ({e.strerror})"
    return None


def _all_devices_sum() -> float:
    """Sum of one 1.0 per device, computed across every process's devices."""
    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    sharding = NamedSharding(mesh, P("all"))
    ones = jax.make_array_from_callback((jax.device_count(),), sharding,
                                        lambda index: np.ones((1,), np.float32))
    return float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(ones))


def _batch_problems(config, mesh) -> list[str]:
    """Whether the train batch splits over the mesh and the processes."""
    try:
        data = loader_options(config.train_dataset)   # the block --train_dataset.type reads
    except UserError as e:
        return [str(e)]
    problems = []
    try:
        check_batch_split(data.batch_size, mesh.shape, config.optimizer.accumulate_gradient_steps)
    except UserError as e:
        problems.append(str(e))
    if data.batch_size % jax.process_count():
        problems.append(f"--train_dataset batch size {data.batch_size} does not split "
                        f"over the {jax.process_count()} processes")
    return problems


def _model_problems(config, family, mesh) -> list[str]:
    """What the trainer refuses at its start of the model and the rows on this mesh
    (`options.mesh_problems`), from the model's config (a checkpoint's config.json or
    metadata, else the preset, with the --<family>.* flags given)."""
    try:
        model_config = model_flags.model_config(family, config, from_checkpoint=True)
    except UserError as e:
        return [str(e)]
    lengths, problems = {}, []
    try:
        lengths["train_dataset"] = loader_options(config.train_dataset).seq_length
    except UserError:
        pass  # a block the type does not read: `_batch_problems` says so
    if config.eval_freq > 0:
        try:
            lengths["eval_dataset"] = loader_options(config.eval_dataset,
                                                     "eval_dataset").seq_length
        except UserError as e:
            problems.append(str(e))
    try:  # the objective's own checks (e.g. the GRPO tools it would import)
        objectives.check_config(config)
    except UserError as e:
        problems.append(str(e))
    return problems + variants.training_problems(family, config) + trainer.mesh_problems(
        config, model_config, mesh.shape, lengths) + _image_problems(config, family,
                                                                     model_config)


def _image_problems(config, family, model_config) -> list[str]:
    """An image-text model's image chats: its image processor, and each image of the first
    IMAGE_ROWS rows of a json source read (a missing or unreadable one: a line naming the
    file and row); a token cache built for this model's reader (and only if it holds
    images)."""
    from easylm.data.cache_reader import CacheSource
    from easylm.data.images import first_rows_problems
    from easylm.models.vision import processor_directory

    data = config.train_dataset
    if not data.text_processor.chat or data.type not in ("json", "cache"):
        return []
    try:
        images = family.image_chats(model_config, processor_directory(config.tokenizer,
                                                                      config.load_checkpoint))
        if data.type == "cache" and data.cache.path:
            CacheSource(data.cache.path).check_images(images)
    except UserError as e:
        return [str(e)]
    if data.type == "cache":
        return []
    path = data.json_dataset.path
    if images is None or not os.path.isfile(path):
        return []
    return first_rows_problems(path, IMAGE_ROWS)


def check(config, family=None) -> tuple[list[str], list[str]]:
    """(report lines, problem lines) for this process; the model's and the rows' checks
    when the `family` is given."""
    from jax.experimental import multihost_utils

    report, problems = [versions()], []
    device = jax.devices()[0]
    report.append(f"backend {jax.default_backend()}: {jax.device_count()} {device.device_kind} "
                  f"device(s), {jax.process_count()} process(es)")
    local_counts = np.asarray(multihost_utils.process_allgather(
        np.int32(jax.local_device_count()))).ravel()
    report.append("devices per process: " + ", ".join(
        f"{i}: {n}" for i, n in enumerate(local_counts)))

    expected = config.jax_distributed.num_processes
    if config.jax_distributed.initialize and expected and jax.process_count() != expected:
        problems.append(f"{jax.process_count()} processes joined but "
                        f"--jax_distributed.num_processes={expected}")
    total = _all_devices_sum()
    if total != jax.device_count():
        problems.append(f"a sum over all devices gave {total:g}, expected "
                        f"{jax.device_count()}: the collectives do not reach every device")
    else:
        report.append(f"all {jax.process_count()} process(es) joined; a sum over all "
                      f"{jax.device_count()} devices is correct")

    try:
        mesh = make_mesh(config.mesh_dim, dcn_mesh_dim=config.dcn_mesh_dim)
    except UserError as e:
        problems.append(str(e))
    else:
        dcn = f", --dcn_mesh_dim={config.dcn_mesh_dim}" if config.dcn_mesh_dim else ""
        report.append(f"mesh: {mesh_string(mesh)} (--mesh_dim={config.mesh_dim}{dcn})")
        problems += _batch_problems(config, mesh)
        if family is not None:
            problems += _model_problems(config, family, mesh)

    # The trainer's --compilation_cache_dir (JAX_COMPILATION_CACHE_DIR when that is '').
    cache = os.path.expanduser(config.compilation_cache_dir or jax.config.jax_compilation_cache_dir or "")
    if cache:
        why = _writable(cache)
        if why:
            problems.append(f"compilation cache: {why}")
        else:
            report.append(f"compilation cache: {cache} (writable)")
    else:
        report.append("compilation cache: off (set --compilation_cache_dir to reuse "
                      "compilations across runs)")
    why = _writable(config.logger.output_dir)
    if why:
        problems.append(f"--logger.output_dir: {why}")
    return report, problems


@exit_on_user_error
def main(argv=None):
    from easylm.models import registry

    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    usage = "usage: python -m easylm.doctor [--family=NAME] [trainer flags]"
    # The trainer's run defaults too (rows no longer than the model takes, eval rows like
    # the train rows): the lengths checked are those the run would read.
    config = flag_lib.parse(trainer.default_config(family), trainer.help_entries(family), argv,
                            usage, derived=trainer.family_run_defaults(family))
    distributed.initialize(config.jax_distributed)
    report, problems = check(config, family)
    process = jax.process_index()
    if process == 0:
        print("\n".join(report))
    prefix = f"[process {process}] " if process else ""
    for line in problems:
        print(f"{prefix}problem: {line}", file=sys.stderr)
    if process == 0 and not problems:
        print("no problems found")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
