"""What checking a restored entry by device digests (foretell.store.digest) costs where MLX
runs: the 4B shape's 604 MB entry as 72 uint8 buffers of [1, 8, 4096, 256] (bf16 K/V of
36 layers), digested as a restore would (first call; then warm), by the CUDA kernel where MLX runs on
one, and by the MLX ops, each checked against the numpy oracle. Prints medians in ms.

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
print(f"first call ({digest._KERNEL_STATE[0]} kernel): {first:.1f} ms")
warm = [timed(lambda: digest.digests(buffers))[0] for _ in range(turns)]
print(f"warm: median {statistics.median(warm):.2f} ms, min {min(warm):.2f}, max {max(warm):.2f}")

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
