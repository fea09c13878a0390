"""saev's DataLoaders, served by shardcastd: a one-line import change.

    # from saev.data import shuffled
    from shardcast.compat.saev import shuffled
    cfg = shuffled.Config(shard_root="/fs/acts/<hash>", patches="image", layer=-2,
                          batch_size=16384)
    for batch in shuffled.DataLoader(cfg):
        batch["act"], batch["image_i"], batch["patch_i"]

The configs take saev's fields under both spellings: protocol "1.0.0"
(`shard_root`, `patches` = "cls" / "image" / "all") and saev's current code
(`shards`, `tokens` = "special" / "content" / "all"); `layer` is a recorded
layer value or "all". Batches carry the keys that protocol's readers expect:
`act`, `image_i`, `patch_i` for a "1.x" dataset, `act`, `example_idx`,
`token_idx` for a "2.x" one (token indices count content tokens; -1 is CLS).
The shards directory's name is the dataset's id on the daemon, found at
`address` or $SHARDCAST_ADDRESS. saev's performance settings (threads, buffer
sizes, timeouts, logging) are accepted and unused: the daemon does the
loading. `scale_norm=True` raises NotImplementedError, as in saev.
"""

from shardcast.compat.saev._loaders import (OrderedConfig, OrderedDataLoader,
                                            ShuffledConfig, ShuffledDataLoader)

__all__ = ["OrderedConfig", "OrderedDataLoader", "ShuffledConfig",
           "ShuffledDataLoader"]
