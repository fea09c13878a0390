"""saev.data.shuffled, served by shardcastd (see shardcast.compat.saev)."""

from shardcast.compat.saev._loaders import ShuffledConfig as Config
from shardcast.compat.saev._loaders import ShuffledDataLoader as DataLoader

__all__ = ["Config", "DataLoader"]
