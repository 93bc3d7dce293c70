"""A batch cache's writes build small graphs: on a GPU every node of a decode step is host
work (its kernel launch), and a batch whose rows joined at different times (rows of
different lengths) pays its write once per layer and step."""

import re
import tempfile

import mlx.core as mx
import pytest

from foretell.model.batch import BatchKVCache
from foretell.model.kvcache import KVCache


def graph_nodes(*outputs: mx.array) -> int:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return len(re.findall("shape=rectangle", dot.read()))


def batch_of(lengths: list[int]) -> BatchKVCache:
    rows = []
    for n in lengths:
        row = KVCache()
        row.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
        rows.append(row)
    batch = BatchKVCache()
    batch.append(rows)
    mx.eval(batch.offset, batch.mask(1) if len(set(lengths)) > 1 else [])
    mx.eval(batch._k, batch._v)
    return batch


@pytest.mark.parametrize(("tokens", "extra"), [(1, 4), (3, 8)])
def test_rows_of_different_lengths_write_with_about_the_nodes_of_rows_in_step(tokens, extra):
    new = mx.ones((2, 2, tokens, 8))
    mx.eval(new)
    in_step = graph_nodes(*batch_of([5, 5]).update_and_fetch(new, new))
    ragged = graph_nodes(*batch_of([5, 6]).update_and_fetch(new, new))
    # Advanced indexing (rows x slots) built about 35 nodes for the same write.
    assert ragged <= in_step + extra
