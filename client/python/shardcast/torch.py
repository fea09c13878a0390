"""PyTorch adapter: a shardcastd stream as a torch IterableDataset.

    from shardcast.torch import ShardcastDataset
    data = ShardcastDataset(dataset_id, layer=12, batch_size=4096, epochs=1,
                            pin_memory=True)
    for batch in torch.utils.data.DataLoader(data, batch_size=None):
        x = batch["vectors"].cuda(non_blocking=True)   # [4096, d_model]

Each item is a whole batch: a dict of tensors made without copies from the
stream's numpy views ("vectors" float32 [B, D], "example_idx" int64,
"token_idx" int32, and "layer" / "labels" when the stream has them). On the
shared-memory path "vectors" views the daemon's slot and stays valid until
the next batch is drawn (pass copy=True to keep batches longer).

To the GPU: device="cuda" yields "vectors" already on the device. The slots
are registered with CUDA (cudaHostRegister), each batch goes from its slot
to the GPU by DMA on a side stream (no CPU copy) while the previous step
runs, the stream current when the batch is drawn waits for the copy (use
the batch on that stream, or make yours wait for it), and the slot goes back
to the daemon only once the copy has finished reading it; copy= is ignored
(the device tensor is the copy).
pin_memory=True instead yields the slot's view in registered memory, for
your own .cuda(non_blocking=True): that copy runs when the GPU gets to it,
so before the slot goes back (when you ask for the next batch) the adapter
waits for the GPU's queued work (torch.cuda.synchronize()). device= does
not wait for the training step, only for the copy.

Partitions: rank and world size come from torch.distributed when it is
initialised (or are given), and DataLoader workers split a rank's partition
further (worker w of n reads partition rank * n + w of world_size * n). With
workers, torch moves each batch to the main process through its own shared
memory (a copy); num_workers=0 is the zero-copy setting, and the daemon does
the loading work anyway.

Checkpointing: state_dict() holds the last batch's resume token;
load_state_dict() makes the next iteration continue right after it.
"""

import torch
import torch.utils.data

from shardcast._client import Client


class _DeviceCopier:
    """Copies batches from slot views to a CUDA device on a side stream.

    copy() returns the device tensor at once (the DMA is queued); wait()
    returns when the last copy has finished reading its slot, after which
    the slot may be given back.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.event = None

    def copy(self, host):
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = host.to(self.device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        current.wait_stream(self.stream)
        # Freed tensors go back to the caching allocator per stream: tell it
        # the current stream uses this one too.
        out.record_stream(current)
        return out

    def wait(self):
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def _register(buffer):
    """Registers a mapped region with CUDA (page-locked: DMA-able)."""
    import ctypes
    view = (ctypes.c_char * len(buffer)).from_buffer(buffer)
    address = ctypes.addressof(view)
    del view  # the mapping must not stay exported
    err = torch.cuda.cudart().cudaHostRegister(address, len(buffer), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {len(buffer)} bytes failed: {err}")
    return address


class ShardcastDataset(torch.utils.data.IterableDataset):
    """Batches of a shardcastd stream as dicts of tensors (see the module).

    `address` defaults to $SHARDCAST_ADDRESS; the other arguments are those
    of Client.stream (dtype="bfloat16" yields torch.bfloat16 tensors, viewed
    in place). `rank`/`world_size` default to torch.distributed's.
    """

    def __init__(self, dataset, *, address=None, layer=None, tokens="content",
                 order="shuffled", batch_size=4096, seed=0, epochs=1,
                 drop_last=False, exclude_labels=(), rank=None, world_size=None,
                 pin_memory=False, device=None, copy=False, shared_memory=True,
                 slots=4, dtype="float32", scale_norm=False, center=False):
        super().__init__()
        self.dataset = dataset
        self.address = address
        self.kwargs = dict(layer=layer, tokens=tokens, order=order,
                           batch_size=batch_size, seed=seed, epochs=epochs,
                           drop_last=drop_last, exclude_labels=tuple(exclude_labels),
                           copy=copy, dtype=dtype, scale_norm=scale_norm,
                           center=center)
        self.rank, self.world_size = rank, world_size
        self.pin_memory = pin_memory
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"device={device!r}: a CUDA device (for CPU tensors leave it "
                             "None, and pass copy=True to keep batches past the next)")
        self.device = device
        self.shared_memory = shared_memory
        self.slots = slots
        self._resume_token = b""
        self._last_token = b""

    def partition(self):
        """(rank, world_size) this iterator reads, workers included."""
        rank, world = self.rank, self.world_size
        if rank is None or world is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world = dist.get_world_size() if world is None else world
            else:
                rank = 0 if rank is None else rank
                world = 1 if world is None else world
        info = torch.utils.data.get_worker_info()
        if info is not None:
            rank, world = rank * info.num_workers + info.id, world * info.num_workers
        return rank, world

    def __iter__(self):
        rank, world = self.partition()
        # In a DataLoader worker an item is pickled for the main process by
        # the queue's feeder thread, after this generator has moved on and
        # the slot may hold a later batch: workers take owned copies.
        kwargs = dict(self.kwargs)
        if torch.utils.data.get_worker_info() is not None:
            if self.device is not None:
                raise RuntimeError(
                    f"ShardcastDataset(device={self.device!r}) runs in the process that "
                    "trains: use DataLoader(num_workers=0) (the daemon does the loading; "
                    "CUDA does not work in DataLoader workers)")
            kwargs["copy"] = True
        if self.device is not None:
            kwargs["copy"] = False  # the device tensor is the copy
        # A client per iterator (per worker process): channels do not survive
        # a fork.
        client = Client(self.address, shared_memory=self.shared_memory,
                        slots=self.slots)
        try:
            stream = client.stream(self.dataset, rank=rank, world_size=world,
                                   resume_token=self._resume_token, **kwargs)
        except BaseException:
            client.close()
            raise
        self._resume_token = b""
        registered = None
        copier = _DeviceCopier(self.device) if self.device is not None else None
        # After a batch is used: what must happen before its slot goes back
        # (it goes back when the stream is asked for the next batch).
        if copier is not None:
            settle = copier.wait
        elif self.pin_memory and stream.shared_memory and not kwargs["copy"]:
            settle = torch.cuda.synchronize
        else:
            settle = None
        try:
            if (self.pin_memory or copier is not None) and stream.shared_memory:
                registered = _register(stream._region.buffer)
            for b in stream:
                if b.dtype == "bfloat16":  # numpy has no bfloat16: its bits
                    vectors = torch.from_numpy(b.vectors.view("<i2")).view(torch.bfloat16)
                else:
                    vectors = torch.from_numpy(b.vectors)
                if copier is not None:
                    vectors = copier.copy(vectors)
                elif self.pin_memory and not stream.shared_memory:
                    vectors = vectors.pin_memory()
                item = {"vectors": vectors,
                        "example_idx": torch.from_numpy(b.example_idx.copy()),
                        "token_idx": torch.from_numpy(b.token_idx.copy())}
                if b.layer is not None:
                    item["layer"] = torch.from_numpy(b.layer.copy())
                if b.labels is not None:
                    item["labels"] = torch.from_numpy(b.labels.copy())
                self._last_token = b.resume_token
                yield item
                if settle is not None:
                    settle()
        finally:
            try:
                # The region is unmapped by close(): no copy may still read it.
                if settle is not None:
                    settle()
            finally:
                stream.close()
                if registered is not None:
                    torch.cuda.cudart().cudaHostUnregister(registered)
                client.close()

    def state_dict(self):
        """{"resume_token": the last batch's token} (bytes)."""
        return {"resume_token": self._last_token}

    def load_state_dict(self, state):
        """The next iteration continues right after the saved batch."""
        self._resume_token = bytes(state.get("resume_token", b""))
