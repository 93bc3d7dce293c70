"""What checking a restored entry by device digests (foretell.store.digest) costs where MLX
runs: the 4B shape's 604 MB entry as 72 uint8 buffers of [1, 8, 4096, 256] (bf16 K/V of
36 layers), digested as a restore would (first call, weights built; then warm), against a
variant fused by mx.compile. Prints medians in ms.

    python scripts/device_digest_probe.py [TURNS]
"""

import statistics
import sys
import time

import mlx.core as mx

from foretell.store import digest

turns = int(sys.argv[1]) if len(sys.argv) > 1 else 15
print("mlx", mx.__version__, mx.default_device())
buffers = [mx.random.randint(0, 256, (1, 8, 4096, 256)).astype(mx.uint8) for _ in range(72)]
mx.eval(buffers)
print("entry bytes", sum(b.nbytes for b in buffers))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


first, expected = timed(lambda: digest.digests(buffers))
print(f"first call (weights built): {first:.1f} ms")
warm = [timed(lambda: digest.digests(buffers))[0] for _ in range(turns)]
print(f"warm: median {statistics.median(warm):.2f} ms, min {min(warm):.2f}, max {max(warm):.2f}")

weights = digest._weights(buffers[0].size // 4)
fused = mx.compile(lambda w, x: mx.sum(x.astype(mx.uint64) * w))


def compiled():
    words = [b.reshape(-1).view(mx.uint32) for b in buffers]
    return [int(s) for s in mx.stack([fused(weights[:w.size], w) for w in words]).tolist()]


first_c, got = timed(compiled)
assert got == expected, "compiled digest differs"
warm_c = [timed(compiled)[0] for _ in range(turns)]
print(f"compiled: first {first_c:.1f} ms, warm median {statistics.median(warm_c):.2f} ms")


def one_tensor():
    return int(mx.sum(buffers[0].reshape(-1).view(mx.uint32).astype(mx.uint64) * weights[:buffers[0].size // 4]))


ones = [timed(one_tensor)[0] for _ in range(turns)]
print(f"one tensor of 8 MiB, synced: median {statistics.median(ones):.3f} ms")
