"""saev.data.indexed, served by shardcastd (see shardcast.compat.saev)."""

from shardcast.compat.saev._loaders import IndexedConfig as Config
from shardcast.compat.saev._loaders import IndexedDataset as Dataset

__all__ = ["Config", "Dataset"]
