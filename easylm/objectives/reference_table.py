"""Precomputed reference log-probabilities (`--dpo.precompute_reference=True`): one pass
over the train and eval pairs before training stores the reference's log-probabilities of
each pair in RUN_DIR/reference_logps.npz, found again by a hash of the pair's rows, so that
training holds one model."""

import hashlib
import io
from typing import Callable

import jax
import numpy as np
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from easylm.errors import UserError

REFERENCE_FILE = "reference_logps.npz"
# The rows of one side of a pair (`chosen_<key>`, `rejected_<key>`), and what a
# precomputed reference adds to a batch: (b,) log-probabilities of each side.
ROW_KEYS = ("input_tokens", "target_tokens", "loss_masks")
REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")


def compute(reference_logps: Callable, params, datasets, place, path) -> "ReferenceTable":
    """One pass over every pair of `datasets` (eval-style, one pass each), in source
    order: `reference_logps(params, batch)` (REFERENCE_KEYS -> (B,)) by pair. Every
    process gets all of them."""
    mesh = jax.sharding.get_abstract_mesh()
    logps = jax.jit(reference_logps, out_shardings=NamedSharding(mesh, P()))
    keys, values = [], []
    for dataset in datasets:
        try:
            for batch, _ in dataset.iterate():
                out = jax.device_get(logps(params, place(batch)))   # (B,) each
                local = np.stack([pair_keys(batch), has_pair(batch)], 1)
                gathered = _gather_rows(local.view(np.uint32)).view(np.uint64)
                rows = gathered[:, 1] > 0   # padding rows at the end of the pass
                keys.append(gathered[rows, 0])
                values.append(np.stack([out[k] for k in REFERENCE_KEYS], 1)[rows])
        finally:
            dataset.close()
    return ReferenceTable(np.concatenate(keys), np.concatenate(values), path)


def pair_keys(batch) -> np.ndarray:
    """(b,) uint64: a hash of each pair's rows (both sides' tokens and masks, and an image
    pair's pixels), so that a pair's reference log-probabilities are found whatever its
    slot, epoch or host."""
    arrays = [np.ascontiguousarray(batch[f"{side}_{k}"]) for side in ("chosen", "rejected")
              for k in ROW_KEYS + ("pixel_values",) if f"{side}_{k}" in batch]
    keys = np.empty(len(arrays[0]), np.uint64)
    for r in range(len(keys)):
        digest = hashlib.blake2b(digest_size=8)
        for array in arrays:
            digest.update(array[r].tobytes())
        keys[r] = int.from_bytes(digest.digest(), "little")
    return keys


def has_pair(batch) -> np.ndarray:
    """(b,) uint64 1 where the row holds a pair, 0 for a padding row."""
    return ((batch["chosen_loss_masks"].sum(1) > 0) &
            (batch["rejected_loss_masks"].sum(1) > 0)).astype(np.uint64)


def _gather_rows(local: np.ndarray) -> np.ndarray:
    """This process's rows -> every process's, in global row order."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


class ReferenceTable:
    """Reference log-probabilities of pairs by `pair_keys`: keys (n,) uint64, values
    (n, 2) float32 (chosen, rejected). Stored as .npz (no pickle) with the reference it
    came from (--load_checkpoint, or the seed of the initialisation)."""

    def __init__(self, keys, values, path):
        keys, first = np.unique(keys, return_index=True)   # sorted; a repeated pair once
        self.keys, self.values = keys, np.asarray(values, np.float32)[first]
        self.path = path   # where it is stored, for the messages

    def __len__(self):
        return len(self.keys)

    def lookup(self, batch) -> dict:
        keys = pair_keys(batch)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        found = self.keys[at] == keys
        missing = ~found & (has_pair(batch) > 0)
        if missing.any():
            raise UserError(f"{missing.sum()} pair(s) of a batch have no precomputed reference "
                            f"log-probabilities in {self.path}: the data changed since they "
                            f"were computed; delete that file to compute them again")
        values = np.where(found[:, None], self.values[at], 0.0).astype(np.float32)
        return dict(zip(REFERENCE_KEYS, values.T))

    def save(self, source: str) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, keys=self.keys, values=self.values, source=np.array(source))
        path = epath.Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / (path.name + ".tmp")   # a killed save leaves no half file
        tmp.write_bytes(buffer.getvalue())
        tmp.rename(path)

    @classmethod
    def load(cls, path: str, source: str) -> "ReferenceTable":
        try:
            with np.load(io.BytesIO(epath.Path(path).read_bytes()), allow_pickle=False) as f:
                keys, values, stored = f["keys"], f["values"], str(f["source"])
        except (OSError, ValueError, KeyError):
            raise UserError(f"{path} is not the .npz of reference log-probabilities this "
                            f"command writes (keys, values, source); delete it to compute "
                            f"them again") from None
        if stored != source:
            raise UserError(f"{path} holds the log-probabilities of the reference {stored}, "
                            f"but this run's reference is {source}; delete it to compute "
                            f"them again")
        return cls(keys, values, path)
