"""How fast can a loader feed a sparse-autoencoder trainer on a GPU?

Trains a ReLU SAE (d_model -> width -> d_model, MSE + L1, Adam, bf16 autocast) and counts
training vectors per second in a steady-state window, with the batches coming from:
  synthetic  : a batch already on the GPU (the GPU's own demand: the upper bound)
  shardcast  : a shardcastd Stream over its Unix socket, stock grpcio stub (stub dir in --stubs)
  package    : the shardcast Python package (client/python, in --package):
               shardcast.torch.ShardcastDataset(device=...) over shared memory, each batch
               copied from its registered slot to the GPU by DMA on a side stream
  saev       : saev's own shuffled DataLoader (needs saev + shims on PYTHONPATH)
A feeder thread turns each batch into a pinned tensor and copies it to the GPU while the
previous step runs (queue of 4), as a careful trainer would.

This is ../shared/bench/gpu/sae_feed.py with the `package` mode added (same SAE, same window,
so the figures compare) and --device cpu for a smoke test on a machine without a GPU.

usage: sae_feed.py MODE [--server unix:PATH --dataset ID | --shards DIR] [--layer 12]
                   [--package client/python] [--device cuda]
                   [--batch 4096] [--width 16384] [--max-s 30] [--label X] [--out F]
Prints one JSON line.
"""

import argparse
import json
import queue
import sys
import threading
import time

import numpy as np
import torch

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["synthetic", "shardcast", "saev", "package"])
p.add_argument("--server", default="")
p.add_argument("--dataset", default="")
p.add_argument("--shards", default="")
p.add_argument("--stubs", default="")
p.add_argument("--package", default="", help="directory holding the shardcast package")
p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
p.add_argument("--layer", type=int, default=12)
p.add_argument("--d-model", type=int, default=1024)
p.add_argument("--batch", type=int, default=4096)
p.add_argument("--width", type=int, default=16384)
p.add_argument("--max-s", type=float, default=30.0)
p.add_argument("--warmup-steps", type=int, default=10)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--label", default="")
p.add_argument("--out", default="")
args = p.parse_args()

dev = torch.device(args.device)
cuda = dev.type == "cuda"


def sync():
    if cuda:
        torch.cuda.synchronize()


torch.manual_seed(args.seed)
torch.backends.cuda.matmul.allow_tf32 = True
d, w = args.d_model, args.width
W_enc = torch.nn.Parameter(torch.randn(d, w, device=dev) / d**0.5)
b_enc = torch.nn.Parameter(torch.zeros(w, device=dev))
W_dec = torch.nn.Parameter(torch.randn(w, d, device=dev) / w**0.5)
b_dec = torch.nn.Parameter(torch.zeros(d, device=dev))
opt = torch.optim.Adam([W_enc, b_enc, W_dec, b_dec], lr=1e-4)


def step(x):
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        f = torch.relu((x - b_dec) @ W_enc + b_enc)
        x_hat = f @ W_dec + b_dec
        loss = (x_hat.float() - x).pow(2).mean() + 1e-3 * f.float().abs().sum(-1).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


q: "queue.Queue" = queue.Queue(maxsize=4)
stop = threading.Event()
fed_err = []


def put(host_array):
    t = torch.from_numpy(host_array).pin_memory()
    q.put(t.to(dev, non_blocking=True))


def feed_synthetic():
    x = torch.randn(args.batch, d, device=dev)
    while not stop.is_set():
        q.put(x)


def feed_shardcast():
    import grpc
    sys.path.insert(0, args.stubs)
    from shardcast.v1 import shardcast_pb2 as pb2, shardcast_pb2_grpc as pb2_grpc
    ch = grpc.insecure_channel(args.server, options=[("grpc.max_receive_message_length", -1)])
    stub = pb2_grpc.StreamStub(ch)
    req = pb2.StreamRequest(dataset=args.dataset, layer=args.layer, tokens=pb2.TOKENS_CONTENT,
                            order=pb2.ORDER_SHUFFLED, batch_size=args.batch, seed=args.seed,
                            epochs=0, drop_last=True)
    for b in stub.Stream(req):
        if stop.is_set():
            break
        put(np.frombuffer(b.vectors, dtype=np.float32).reshape(b.rows, b.d_model))


def feed_package():
    if args.package:
        sys.path.insert(0, args.package)
    from shardcast.torch import ShardcastDataset
    # On a CPU there is no copy to wait for: owned batches instead of slot views.
    data = ShardcastDataset(args.dataset, address=args.server, layer=args.layer,
                            tokens="content", batch_size=args.batch, seed=args.seed, epochs=0,
                            drop_last=True, device=dev if cuda else None, copy=not cuda)
    for item in torch.utils.data.DataLoader(data, batch_size=None):
        if stop.is_set():
            break
        q.put(item["vectors"])


def feed_saev():
    import pathlib
    import saev_boot  # noqa: F401
    from saev.data import shuffled
    cfg = shuffled.Config(shards=pathlib.Path(args.shards), tokens="content", layer=args.layer,
                          batch_size=args.batch)
    while not stop.is_set():
        for b in shuffled.DataLoader(cfg):
            if stop.is_set():
                return
            q.put(b["act"].pin_memory().to(dev, non_blocking=True))


def run_feeder(fn):
    try:
        fn()
    except Exception as e:  # report, don't hang the trainer
        fed_err.append(repr(e))
        stop.set()


feeder = threading.Thread(target=run_feeder, args=({"synthetic": feed_synthetic, "shardcast": feed_shardcast,
                                                     "saev": feed_saev, "package": feed_package}[args.mode],),
                          daemon=True)
t_start = time.perf_counter()
feeder.start()
n_steps = 0
t0 = None
first_batch_s = None
starved_s = 0.0
while True:
    tw = time.perf_counter()
    x = None
    while x is None and not fed_err and time.perf_counter() - tw < 120:
        try:  # a feeder that failed ends the run at once, not after the timeout
            x = q.get(timeout=0.2)
        except queue.Empty:
            pass
    if x is None:
        if not fed_err:
            fed_err.append("no batch for 120 s")
        break
    waited = time.perf_counter() - tw
    if first_batch_s is None:
        first_batch_s = time.perf_counter() - t_start
    step(x)
    n_steps += 1
    if n_steps == args.warmup_steps:
        sync()
        t0 = time.perf_counter()
        starved_s = 0.0
        n0 = n_steps
    elif t0 is not None:
        starved_s += waited
        if time.perf_counter() - t0 >= args.max_s:
            break
    if fed_err:
        break
sync()
t1 = time.perf_counter()
stop.set()
res = dict(mode=args.mode, label=args.label, batch=args.batch, width=w, d_model=d,
           gpu=torch.cuda.get_device_name(0) if cuda else "cpu", error=fed_err[:1])
if t0 is not None:
    steps = n_steps - n0
    res.update(steps=steps, seconds=round(t1 - t0, 3), vec_s=round(steps * args.batch / (t1 - t0), 1),
               MB_s=round(steps * args.batch * d * 4 / 1e6 / (t1 - t0), 1),
               starved_fraction=round(starved_s / (t1 - t0), 3), first_batch_s=round(first_batch_s, 3))
line = json.dumps(res)
print(line, flush=True)
if args.out:
    with open(args.out, "a") as f:
        f.write(line + "\n")
import os
os._exit(0)
