"""The data pipeline: sources, EasyLM's text processing, packing, per-host sharding,
exact resumable state. See docs/data.md."""

from easylm.data.dataset import Dataset, DatasetFactory, make_global_batch, merge_state_dicts
from easylm.data.text import TextProcessor

__all__ = ["Dataset", "DatasetFactory", "TextProcessor", "make_global_batch",
           "merge_state_dicts"]
