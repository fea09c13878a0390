"""The main job as a user sees it (README, "Python"): an extraction loop
writes a dataset with shardcast.Writer, then a tiny sparse autoencoder
trains on the CPU, fed by the Python package; prints vectors/s.

    /usr/bin/python3 deploy/demo_sae.py [ROOT]      # deploy/demo.sh runs it

Without SHARDCAST_ADDRESS the package finds the node's daemon or starts
the user's own (docs/python.md, "Datasets by path, and no setup").
"""

import os
import sys
import time

import numpy as np
import torch

import shardcast
from shardcast.torch import ShardcastDataset

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/shardcast-demo-sae"
n, layers, tokens, d = 4096, [12], 16, 64

# 1. Extraction: batches of activations (random stand-ins for a model's).
t0 = time.perf_counter()
rng = np.random.default_rng(0)
with shardcast.Writer(root, layers=layers, tokens=tokens, cls_token=False,
                      d_model=d, n_examples=n) as w:
    for start in range(0, n, 512):
        w.append(rng.standard_normal((512, len(layers), tokens, d), dtype=np.float32))
path = w.path
print(f"wrote {n * tokens * d * 4 / 2**20:.0f} MiB with shardcast.Writer in "
      f"{time.perf_counter() - t0:.2f} s -> {path}")

# 2. Training: the loop of README.md's Python section.
torch.set_num_threads(os.cpu_count())
sae = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.ReLU(), torch.nn.Linear(4 * d, d))
opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
data = ShardcastDataset(path, layer=12, batch_size=4096, epochs=2)
t0, seen = time.perf_counter(), 0
for batch in torch.utils.data.DataLoader(data, batch_size=None):
    x = batch["vectors"]
    loss = ((sae(x) - x) ** 2).mean() + 1e-3 * sae[1](sae[0](x)).abs().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    seen += x.shape[0]
dt = time.perf_counter() - t0
print(f"tiny SAE on the CPU ({torch.get_num_threads()} threads): {seen} vectors in "
      f"{dt:.2f} s, {seen / dt:,.0f} vectors/s, last loss {loss.item():.3f}")
