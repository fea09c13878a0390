"""shardcast: cached transformer activations from a shardcastd daemon.

    import shardcast
    client = shardcast.Client("unix:/run/shardcast/shardcastd.sock")
    for batch in client.stream(dataset_id, layer=12, batch_size=4096, epochs=1):
        train_step(batch.vectors)   # float32 [4096, d_model], a view of shared memory

See docs/python.md, for the API, shardcast.torch for a PyTorch
IterableDataset, shardcast.compat.saev for saev's DataLoaders, and
shardcast.write / shardcast.Writer for writing datasets.
"""

from shardcast._client import (ADDRESS_VARIABLE, Batch, Client, Error, Stream,
                               bfloat16_to_float32)
from shardcast._writer import WriteProgress, Writer, write

__all__ = ["ADDRESS_VARIABLE", "Batch", "Client", "Error", "Stream", "WriteProgress", "Writer",
           "bfloat16_to_float32", "write"]
__version__ = "0.1.0"
