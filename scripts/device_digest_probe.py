"""What checking a restored entry by device digests (foretell.store.digest) costs where MLX
runs, for the 4B shape's entries as a restore holds them: bf16 KV (72 uint8 buffers of
[1, 8, 4096, 256], 604 MB) or 8-bit KV (``kv8``: 216 buffers, each layer's K and V as
packed [1, 8, 4096, 128] and scales and biases of [1, 8, 4096, 4] bytes, 321 MB). Digested
as a restore does (from the read's flat views) and from the arrays, first call then warm,
by the CUDA kernel where MLX runs on one, and by the MLX ops; each checked against the
numpy oracle. Prints medians in ms.

    python scripts/device_digest_probe.py [TURNS] [bf16|kv8]
"""

import statistics
import sys
import time

import mlx.core as mx

from foretell.store import digest

turns = int(sys.argv[1]) if len(sys.argv) > 1 else 15
shape = sys.argv[2] if len(sys.argv) > 2 else "bf16"
rows = [256] if shape == "bf16" else [128, 4, 4]
print("mlx", mx.__version__, mx.default_device(), shape)
buffers = [mx.random.randint(0, 256, (1, 8, 4096, width)).astype(mx.uint8)
           for _ in range(72) for width in rows]
mx.eval(buffers)
views = [memoryview(b).cast("B") for b in buffers]
print("entry bytes", sum(b.nbytes for b in buffers), "tensors", len(buffers))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


first, expected = timed(lambda: digest.digests(buffers, views=views))
print(f"first call ({digest._KERNEL_STATE[0]} kernel): {first:.1f} ms")
warm = [timed(lambda: digest.digests(buffers, views=views))[0] for _ in range(turns)]
print(f"warm, from views: median {statistics.median(warm):.2f} ms, min {min(warm):.2f}, "
      f"max {max(warm):.2f}")
from_arrays = [timed(lambda: digest.digests(buffers))[0] for _ in range(turns)]
assert digest.digests(buffers) == expected, "from arrays and from views disagree"
print(f"warm, from arrays: median {statistics.median(from_arrays):.2f} ms")

state = digest._KERNEL_STATE[0]
digest._KERNEL_STATE[0] = "failed"  # the MLX ops instead of the kernel
first_ops, by_ops = timed(lambda: digest.digests(buffers))
assert by_ops == expected, "the ops and the kernel disagree"
warm_ops = [timed(lambda: digest.digests(buffers))[0] for _ in range(turns)]
print(f"MLX ops: first {first_ops:.1f} ms, warm median {statistics.median(warm_ops):.2f} ms")
digest._KERNEL_STATE[0] = state
raw = bytes(memoryview(buffers[0]))
assert digest.reference(raw) == expected[0], "the numpy oracle disagrees"
print("kernel, ops and numpy agree")
