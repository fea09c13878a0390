"""shardcast.torch (ShardcastDataset) against a real shardcastd
(shardcast.compat.saev: test_package_saev_compat.py).

Expected vectors come from numpy reads of the files (package_fixtures.
Reference); partitions are checked against the rules of
proto/shardcast/v1/shardcast.proto (shuffled: vector g of the selection in
disk order belongs to rank g mod W; ordered: rank r of W gets the contiguous
range [V*r/W, V*(r+1)/W)).

grpcio does not survive a fork in a process that has used it (see
test_workers_fork_while_the_main_process_holds_a_client), so forked
DataLoader workers run in a fresh process that opens no channel itself.
"""

import gc
import json
from pathlib import Path
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.utils.data

from package_fixtures import (CHILD_ENV, Reference, assert_exact_epoch, datasets,  # noqa: F401
                              in_memfd_mapping, package_logs, sockdir, start_daemon)

import shardcast
from shardcast.torch import ShardcastDataset

ALONE = ("--scan-start-delay-ms", "0")


def item_rows(r, item, layer, what="item"):
    """Rows of one ShardcastDataset item (a dict of tensors), after checking
    its types and every vector and label against numpy."""
    v = item["vectors"]
    assert isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.ndim == 2, what
    assert item["example_idx"].dtype == torch.int64, what
    assert item["token_idx"].dtype == torch.int32, what
    if layer is None:
        assert item["layer"].dtype == torch.int64, what
        lay = item["layer"].numpy()
    else:
        assert "layer" not in item, what
        lay = np.full(v.shape[0], layer, dtype=np.int64)
    labels = item.get("labels")
    if labels is not None:
        assert labels.dtype == torch.uint8, what
        labels = labels.numpy()
    return r.rows(v.numpy(), item["example_idx"].numpy(), item["token_idx"].numpy(), lay,
                  labels, what=what)


# ---------------------------------------------------------------------------
# ShardcastDataset in a DataLoader.

FORKED_WORKERS_EPOCH = r"""
import sys
import numpy as np
import torch
import torch.utils.data
from shardcast.torch import ShardcastDataset
address, dataset, out = sys.argv[1:4]
arrays = {}
for order in ("shuffled", "ordered"):
    data = ShardcastDataset(dataset, address=address, layer=None, tokens="all",
                            order=order, batch_size=60, seed=3)
    cols = {"vectors": [], "example_idx": [], "token_idx": [], "layer": [], "labels": []}
    for item in torch.utils.data.DataLoader(data, batch_size=None, num_workers=2,
                                            timeout=30):
        want = {"vectors": torch.float32, "example_idx": torch.int64,
                "token_idx": torch.int32, "layer": torch.int64, "labels": torch.uint8}
        assert set(item) == set(want), sorted(item)
        for k, dtype in want.items():
            assert item[k].dtype == dtype, (k, item[k].dtype)
            cols[k].append(item[k].numpy())
    for k, v in cols.items():
        arrays[f"{order}_{k}"] = np.concatenate(v)
    arrays[f"{order}_items"] = np.array([len(cols["vectors"])])
np.savez(out, **arrays)
"""


def test_two_forked_dataloader_workers_cover_one_epoch_exactly(start_daemon, datasets,
                                                               tmp_path):
    """DataLoader(ShardcastDataset, batch_size=None, num_workers=2) with the
    default (fork) workers, in a fresh training process that opens no
    channel itself (grpcio does not survive a fork otherwise, see
    test_workers_fork_while_the_main_process_holds_a_client): each worker
    streams its own partition, and together they deliver every selected
    (example, layer, token) exactly once with numpy's values, shuffled and
    ordered; items are dicts of tensors (vectors float32 [B, D], example_idx
    int64, token_idx int32, layer int64, labels uint8). Regression: a
    worker's vectors used to be its shared-memory slot, pickled for the main
    process only after the worker had released it, so items arrived with a
    later batch's vectors."""
    d = start_daemon(*ALONE)
    r = datasets.main
    out = tmp_path / "epoch.npz"
    proc = subprocess.run([sys.executable, "-c", FORKED_WORKERS_EPOCH, d.address, r.id,
                           str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=CHILD_ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    got = np.load(out)
    want = r.selection(None, "all")
    for order in ("shuffled", "ordered"):
        rows = r.rows(*(got[f"{order}_{k}"] for k in ("vectors", "example_idx",
                                                       "token_idx", "layer", "labels")),
                      what=order)
        assert_exact_epoch(rows, want, order)
        # Two partitions of 680 vectors in batches of 60: 12 batches each.
        assert int(got[f"{order}_items"][0]) == 24, order


def test_two_spawned_dataloader_workers_cover_one_epoch_exactly(start_daemon, datasets):
    """The same with multiprocessing_context="spawn", in this process and
    while it holds an open shardcast.Client (spawned workers start clean):
    one exact epoch with numpy's values."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with shardcast.Client(d.address) as client:
        assert client.describe(r.id).d_model == r.D
        data = ShardcastDataset(r.id, address=d.address, layer=None, tokens="all",
                                batch_size=60, seed=3)
        loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2,
                                             multiprocessing_context="spawn", timeout=60)
        rows = [row for i, item in enumerate(loader)
                for row in item_rows(r, item, None, f"item {i}")]
    assert_exact_epoch(rows, r.selection(None, "all"))


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_two_ranks_are_disjoint_and_cover_one_epoch(start_daemon, datasets, order):
    """ShardcastDataset(rank=r, world_size=2) for r = 0, 1: each rank gets
    exactly its partition (shuffled: selected vector g goes to rank g mod 2;
    ordered: the two halves, in disk order), so the ranks are disjoint and
    their union is one epoch. With num_workers=0 the vectors are float32
    tensors over the daemon's shared-memory slot, without a copy."""
    d = start_daemon(*ALONE)
    r = datasets.main
    want = r.selection(6)
    per_rank = {}
    for rank in (0, 1):
        data = ShardcastDataset(r.id, address=d.address, layer=6, order=order,
                                batch_size=50, seed=11, rank=rank, world_size=2)
        assert data.partition() == (rank, 2)
        rows = []
        for i, item in enumerate(torch.utils.data.DataLoader(data, batch_size=None)):
            assert in_memfd_mapping(item["vectors"].data_ptr()), (
                f"rank {rank} item {i}: vectors are not the shared-memory slot")
            rows.extend(item_rows(r, item, 6, f"rank {rank} item {i}"))
        per_rank[rank] = rows
    assert not set(per_rank[0]) & set(per_rank[1]), "ranks overlap"
    assert_exact_epoch(per_rank[0] + per_rank[1], want)
    if order == "shuffled":
        for rank in (0, 1):
            assert_exact_epoch(per_rank[rank], want[rank::2], f"rank {rank}")
    else:
        half = len(want) // 2
        assert per_rank[0] == want[:half] and per_rank[1] == want[half:]


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_state_dict_resumes_the_epoch_exactly(start_daemon, datasets, order):
    """state_dict() after some items, load_state_dict() into a new
    ShardcastDataset: the new iteration delivers exactly the rest of the
    epoch (before + after is one exact epoch, nothing twice)."""
    d = start_daemon(*ALONE)
    r = datasets.main
    args = dict(address=d.address, layer=None, tokens="content", order=order,
                batch_size=70, seed=5)
    data = ShardcastDataset(r.id, **args)
    before = []
    it = iter(torch.utils.data.DataLoader(data, batch_size=None))
    for i in range(4):
        before.extend(item_rows(r, next(it), None, f"item {i}"))
    state = data.state_dict()
    del it
    gc.collect()  # ends the first stream
    assert isinstance(state["resume_token"], bytes) and state["resume_token"]

    again = ShardcastDataset(r.id, **args)
    again.load_state_dict(state)
    after = [row for i, item in enumerate(torch.utils.data.DataLoader(again, batch_size=None))
             for row in item_rows(r, item, None, f"resumed item {i}")]
    want = r.selection(None, "content")
    assert 0 < len(before) < len(want)
    assert_exact_epoch(before + after, want)
    if order == "ordered":
        assert before + after == want


# ---------------------------------------------------------------------------
# To the GPU without a GPU: copies that finish late, as DMAs queued behind a
# training step do. A slot that went back to the daemon before its copy was
# done may hold a later batch when the copy reads it: the epoch would then
# have duplicated and missing vectors.

class LateCopier:
    """Stands in for shardcast.torch._DeviceCopier: copy() hands out an
    empty tensor and remembers the slot's view; wait() fills the tensor, as
    the DMA finishing would, after a pause long enough for the daemon to
    fill a slot that was given back too early."""

    def __init__(self, device):
        self.pending = None
        self.copies = 0

    def copy(self, host):
        out = torch.empty_like(host)
        self.pending = (out, host)
        self.copies += 1
        return out

    def wait(self):
        if self.pending is not None:
            time.sleep(0.01)
            out, host = self.pending
            out.copy_(host)
            self.pending = None


def checked_late(r, loader, layer, use):
    """Rows of every item, each checked after the next item was drawn (when
    the copy of a real GPU may only then be done), the last one after the
    loop. `use(item)` is what the training loop does with the vectors."""
    def check(i, item, x):
        return item_rows(r, dict(item, vectors=x), layer, f"item {i}")

    rows, held = [], None
    for i, item in enumerate(loader):
        x = use(item)
        if held is not None:
            rows.extend(check(*held))
        held = (i, item, x)
    rows.extend(check(*held))
    return rows


def test_device_copies_finish_before_their_slot_goes_back(start_daemon, datasets,
                                                          monkeypatch):
    """ShardcastDataset(device=...) gives a slot back only after its copy to
    the device has finished: with copies that finish late and two slots, one
    exact epoch with numpy's values."""
    import shardcast.torch as sctorch
    copiers = []
    monkeypatch.setattr(sctorch, "_DeviceCopier",
                        lambda device: copiers.append(LateCopier(device)) or copiers[-1])
    monkeypatch.setattr(sctorch, "_register", lambda buffer: None)
    d = start_daemon(*ALONE)
    r = datasets.main
    data = ShardcastDataset(r.id, address=d.address, layer=6, batch_size=50, seed=2,
                            slots=2, device="cuda")
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    rows = checked_late(r, loader, 6, lambda item: item["vectors"])
    assert_exact_epoch(rows, r.selection(6))
    assert len(copiers) == 1 and copiers[0].copies == len(rows) // 50 + (len(rows) % 50 > 0)


def test_pin_memory_waits_for_queued_copies_before_the_slot_goes_back(
        start_daemon, datasets, monkeypatch):
    """pin_memory=True hands out the slot's view for the trainer's own
    .cuda(non_blocking=True); before the slot goes back the adapter waits
    for the GPU (torch.cuda.synchronize), which finishes those copies."""
    import shardcast.torch as sctorch
    pending = []

    def late_cuda(self, non_blocking=False):
        out = torch.empty_like(self)
        pending.append((out, self))
        return out

    def synchronize(device=None):
        time.sleep(0.01)
        while pending:
            out, host = pending.pop()
            out.copy_(host)

    monkeypatch.setattr(torch.Tensor, "cuda", late_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(sctorch, "_register", lambda buffer: None)
    d = start_daemon(*ALONE)
    r = datasets.main
    data = ShardcastDataset(r.id, address=d.address, layer=12, batch_size=40, seed=4,
                            slots=2, pin_memory=True)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    rows = checked_late(r, loader, 12,
                        lambda item: item["vectors"].cuda(non_blocking=True))
    assert_exact_epoch(rows, r.selection(12))
    assert not pending


CUDA = torch.cuda.is_available()


def gpu_busy():
    """Queues some milliseconds of work on the current CUDA stream, so that a
    copy queued after it runs late."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        a = a @ a
        a = a / a.norm()


def rows_read_back(r, held, layer):
    """Rows of (item, GPU tensor) pairs once the GPU is done, each checked
    against numpy after copying it back."""
    torch.cuda.synchronize()
    rows = []
    for i, (item, x) in enumerate(held):
        rows.extend(item_rows(r, dict(item, vectors=x.cpu()), layer, f"item {i}"))
    return rows


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the GPU machine)")
@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_device_cuda_epochs_are_exact_on_a_real_gpu(start_daemon, datasets, order):
    """device="cuda" on a real GPU: each batch's DMA from its registered slot
    ends before the slot goes back, while the training stream is busy; the
    epoch read back from the GPU is numpy's, exactly."""
    d = start_daemon(*ALONE)
    r = datasets.main
    data = ShardcastDataset(r.id, address=d.address, layer=6, order=order, batch_size=50,
                            seed=5, slots=2, device="cuda")
    held = []
    for item in torch.utils.data.DataLoader(data, batch_size=None):
        assert item["vectors"].is_cuda
        gpu_busy()
        held.append((item, item["vectors"] * 1.0))  # used on the current stream
    assert_exact_epoch(rows_read_back(r, held, 6), r.selection(6))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the GPU machine)")
def test_pin_memory_cuda_copies_are_exact_on_a_real_gpu(start_daemon, datasets):
    """pin_memory=True on a real GPU: the trainer's .cuda(non_blocking=True)
    runs behind queued work; the slot goes back only after it, and the epoch
    read back from the GPU is numpy's, exactly."""
    d = start_daemon(*ALONE)
    r = datasets.main
    data = ShardcastDataset(r.id, address=d.address, layer=12, batch_size=40, seed=6,
                            slots=2, pin_memory=True)
    held = []
    for item in torch.utils.data.DataLoader(data, batch_size=None):
        gpu_busy()
        held.append((item, item["vectors"].cuda(non_blocking=True)))
    assert_exact_epoch(rows_read_back(r, held, 12), r.selection(12))


def test_a_device_that_is_not_cuda_is_refused_clearly():
    """device= copies to a GPU; a CPU device is an error saying what to use."""
    with pytest.raises(ValueError, match="CUDA device"):
        ShardcastDataset("00000000", address="unix:/nonexistent.sock", device="cpu")


def test_device_in_dataloader_workers_is_refused_clearly(start_daemon, datasets):
    """device= copies from the training process's own mapping of the slots:
    in a DataLoader worker it is an error that says to use num_workers=0."""
    d = start_daemon(*ALONE)
    r = datasets.main
    data = ShardcastDataset(r.id, address=d.address, layer=6, batch_size=50, device="cuda")
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn", timeout=60)
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(loader))


def test_the_gpu_benchmarks_package_mode_trains_on_the_cpu(start_daemon, datasets, tmp_path):
    """tests/bench/gpu/sae_feed.py's `package` mode (what the GPU machine
    measures for issue 9) runs with this package: a few SAE steps on the
    CPU, fed by ShardcastDataset, and a JSON line without errors."""
    d = start_daemon(*ALONE)
    r = datasets.main
    repo = Path(__file__).resolve().parents[3]
    out = tmp_path / "feed.jsonl"
    proc = subprocess.run(
        [sys.executable, str(repo / "tests/bench/gpu/sae_feed.py"), "package", "--device", "cpu",
         "--server", d.address, "--dataset", r.id, "--package", str(repo / "client/python"),
         "--layer", "12", "--d-model", str(r.D), "--batch", "32", "--width", "16",
         "--warmup-steps", "2", "--max-s", "0.5", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=CHILD_ENV, timeout=120)
    err = proc.stderr.decode(errors="replace")[-3000:]
    assert proc.returncode == 0, err
    res = json.loads(out.read_text().splitlines()[-1])
    assert res["error"] == [] and res["steps"] > 0 and res["vec_s"] > 0, res


FORKED_WORKERS = r"""
import sys
import torch.utils.data
import shardcast
from shardcast.torch import ShardcastDataset
address, dataset = sys.argv[1:3]
client = shardcast.Client(address)  # held open, as a training script may
client.describe(dataset)
data = ShardcastDataset(dataset, address=address, layer=12, batch_size=64, seed=1)
loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, timeout=3)
print(sum(item["vectors"].shape[0] for item in loader), flush=True)
"""


def test_workers_forked_after_the_main_process_used_grpc_fail_clearly(start_daemon,
                                                                     datasets):
    """grpcio does not survive fork() after it opened a channel: forked
    DataLoader workers hung or aborted in grpc. They now fail at once with
    an error that says to use multiprocessing_context='spawn'."""
    d = start_daemon(*ALONE)
    r = datasets.main
    env = {k: v for k, v in CHILD_ENV.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    proc = subprocess.run([sys.executable, "-c", FORKED_WORKERS, d.address, r.id],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                          timeout=60)
    err = proc.stderr.decode(errors="replace")[-3000:]
    assert proc.returncode != 0, "forked workers streamed after the parent used grpc?"
    assert "multiprocessing_context='spawn'" in err, err


README_HARNESS = r"""
import sys, numpy as np
root, code = sys.argv[1:3]
np.random.seed(1)  # the loop's stand-in activations, made again by the test
seen = []
code = code.replace('"/tmp/acts"', repr(root))
code = code.replace('x = batch["vectors"];', 'x = batch["vectors"]; seen.append(x.shape[0]);')
exec(code)
print(w.path, sum(seen))
"""


def test_the_readmes_pytorch_loop_runs_against_the_daemon(start_daemon, tmp_path):
    """README.md's "Python" loop, as written: it writes its dataset with
    shardcast.Writer (read back here with numpy: exactly the appended
    activations) and trains over one exact epoch of it from the daemon it
    finds (SHARDCAST_ADDRESS)."""
    import re
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("\n## Python\n"):]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert "ShardcastDataset" in code and "shardcast.Writer" in code
    d = start_daemon(*ALONE, roots=[])
    root = tmp_path / "acts"
    proc = subprocess.run([sys.executable, "-c", README_HARNESS, str(root), code],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(CHILD_ENV, SHARDCAST_ADDRESS=d.address), timeout=120)
    err = proc.stderr.decode(errors="replace")[-3000:]
    assert proc.returncode == 0, err
    path, seen = proc.stdout.decode().split()
    r = Reference(path)
    np.random.seed(1)
    want = np.concatenate([np.random.randn(512, 1, 16, 64).astype(np.float32)
                           for _ in range(8)])
    assert r.acts.shape == want.shape and np.array_equal(r.acts, want)
    assert int(seen) == 4096 * 16  # one epoch of layer 12's content tokens
