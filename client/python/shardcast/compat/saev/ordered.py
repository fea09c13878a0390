"""saev.data.ordered, served by shardcastd (see shardcast.compat.saev)."""

from shardcast.compat.saev._loaders import OrderedConfig as Config
from shardcast.compat.saev._loaders import OrderedDataLoader as DataLoader

__all__ = ["Config", "DataLoader"]
