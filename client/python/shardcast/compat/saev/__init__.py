"""saev's data-loading API (saev.data), served by shardcastd.

Either change the import:

    # import saev.data
    import shardcast.compat.saev as data
    cfg = data.ShuffledConfig(shards=pathlib.Path("/fs/scratch/saev/shards/3f9a2c1d"),
                              layer=13, batch_size=16384)
    for batch in data.ShuffledDataLoader(cfg):
        batch["act"], batch["example_idx"], batch["token_idx"]

or, to run saev's own code (its trainer, saev.framework.train) on the
daemon, make one call before importing it:

    import shardcast.compat.saev
    shardcast.compat.saev.install()      # saev.data now hands out these loaders
    from saev.framework import train

Names, as in saev.data: ShuffledConfig / ShuffledDataLoader, OrderedConfig /
OrderedDataLoader, IndexedConfig / IndexedDataset, Metadata, PixelAgg,
make_ordered_config; and the modules shuffled, ordered (Config, DataLoader),
indexed (Config, Dataset) and shards (Metadata, PixelAgg).

As in saev: the configs' fields, defaults and type checks (beartype's, when
it is installed, as it is beside saev; else TypeError), `shards` a
pathlib.Path of a directory .../saev/shards/<hash>; the loaders' attributes
(n_samples, n_batches, batch_size, drop_last, cfg, metadata and md,
manager_pid, shutdown()), len() and passes (one `for` over a loader is one
epoch); the batch keys and dtypes (shuffled: act float32, example_idx and
token_idx int32; ordered: act, example_idx and token_idx int64 and
token_labels int64 when labels.bin exists; indexed items: act, example_idx,
token_idx, token_label); the ordered order (example by example, token by
token); a shuffled epoch holds every selected vector once and, as in saev,
ends with the short batch even with drop_last=True. The same exceptions for
the same mistakes, naming the path given: RuntimeError for a shards path
that is not a directory; AssertionError for one not ending in
saev/shards/<hash>; FileNotFoundError (saev's message) without
metadata.json or shards.json, for a missing or empty shard file, or for
ignore_labels without labels.bin; NotImplementedError for scale_norm=True
or ignore_labels with other than content tokens of one layer; RuntimeError
at the first batch for a layer the dataset lacks (AssertionError at
construction for IndexedDataset); IndexError out of range.

Beyond saev: selections its loaders do not implement are served, in the
orders above: shuffled tokens "special" ([CLS], token_idx -1) and "all",
and layer "all"; ordered layer "all" (each example's layers in recorded
order); indexed tokens "all" and layer "all". saev's indexed [CLS] items
read the [CLS] of the wrong example past the first; these read the right
one. Each shuffled pass is a new order (seed + pass).

Accepted and unused (they tune saev's reader threads, queues and logs;
the daemon reads, so they change nothing a program sees):
n_threads, buffer_size, batch_timeout_s, debug, log_every_s, use_tmpdir
(saev copies the shards to $TMPDIR first; the daemon already reads each
byte once per node) and min_buffer_fill (saev waits until that fraction of
its reservoir is full before each batch, so that batches mix many shards;
the daemon's shuffle mixes blocks from across the dataset from the first
batch on, whatever the value).

Datasets are named by their path: a loader checks it as saev does, then
asks the daemon with Client.attach(path). The daemon is the one at
install()'s `address`, else $SHARDCAST_ADDRESS. With ignore_labels, the
epoch's size is counted in labels.bin, once, as saev counts it.
"""

from shardcast.compat.saev._install import install
from shardcast.compat.saev._loaders import (IndexedConfig, IndexedDataset,
                                            OrderedConfig, OrderedDataLoader,
                                            ShuffledConfig, ShuffledDataLoader,
                                            make_ordered_config)
from shardcast.compat.saev._metadata import Metadata, PixelAgg

__all__ = ["IndexedConfig", "IndexedDataset", "Metadata", "OrderedConfig",
           "OrderedDataLoader", "PixelAgg", "ShuffledConfig", "ShuffledDataLoader",
           "install", "make_ordered_config"]
