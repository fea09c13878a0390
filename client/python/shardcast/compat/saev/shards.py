"""saev.data.shards' Metadata and PixelAgg (see shardcast.compat.saev)."""

from shardcast.compat.saev._metadata import Metadata, PixelAgg

__all__ = ["Metadata", "PixelAgg"]
