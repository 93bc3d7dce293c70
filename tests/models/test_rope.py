"""RoPE variants against mlx-lm's ``initialize_rope`` on the same inputs, bit for bit.

Each scaling type mlx-lm runs is built by both from one config entry and applied to the
same queries at several offsets and lengths; the outputs must be equal, and must differ
from unscaled RoPE (so the case tests the scaling, not the default path).
"""

import mlx.core as mx
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from foretell.model import make_rope

DIMS = 16
BASE = 1_000_000.0
MAX_POSITIONS = 16

SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn-mscale": {
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.9,
        "mscale_all_dim": 0.5,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 4,
        "short_factor": [1.0] * (DIMS // 2),
        "long_factor": [1.0 + 0.5 * i for i in range(DIMS // 2)],
    },
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize(("length", "offset"), [(12, 0), (1, 5), (1, 40), (7, 30)])
def test_scaled_rope_equals_mlx_lm_and_differs_from_unscaled(name, length, offset):
    scaling = SCALINGS[name]
    x = mx.random.normal((1, 2, length, DIMS), key=mx.random.key(length + offset))
    ours = make_rope(DIMS, base=BASE, scaling=scaling, max_position_embeddings=MAX_POSITIONS)
    theirs = initialize_rope(
        DIMS, BASE, False, scaling_config=scaling, max_position_embeddings=MAX_POSITIONS
    )
    got = ours(x, offset)
    assert mx.array_equal(got, theirs(x, offset=offset))
    if name == "dynamic" and length + offset <= MAX_POSITIONS:
        return  # dynamic NTK only changes the base past max_position_embeddings
    plain = make_rope(DIMS, base=BASE)(x, offset)
    assert not mx.allclose(got, plain, atol=1e-4)


def test_mrope_for_text_is_plain_rope_as_in_mlx_lm():
    scaling = {"type": "mrope", "mrope_section": [2, 3, 3]}
    x = mx.random.normal((1, 2, 5, DIMS), key=mx.random.key(0))
    ours = make_rope(DIMS, base=BASE, scaling=scaling)(x, 3)
    assert mx.array_equal(ours, initialize_rope(DIMS, BASE, False, scaling)(x, offset=3))


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "yarn"}, r"rope_scaling\.factor: expected a number"),
        ({"rope_type": "dynamic", "factor": "2"}, r"rope_scaling\.factor: expected a number"),
        (
            {"rope_type": "longrope", "original_max_position_embeddings": 4,
             "short_factor": [1.0], "long_factor": [1.0]},
            r"rope_scaling\.short_factor: expected 8 numbers",
        ),
        ({"rope_type": "longrope", "short_factor": 1.0, "long_factor": 1.0},
         r"rope_scaling\.original_max_position_embeddings: expected a number"),
        ({"rope_type": "mrope", "mrope_section": [8]}, r"rope_scaling\.mrope_section"),
    ],
)
def test_bad_scaling_fields_are_named(scaling, message):
    with pytest.raises(ValueError, match=message):
        make_rope(DIMS, base=BASE, scaling=scaling, max_position_embeddings=MAX_POSITIONS)


def test_dynamic_scaling_without_max_positions_is_refused_by_name():
    with pytest.raises(ValueError, match="needs a positive max_position_embeddings"):
        make_rope(DIMS, base=BASE, scaling={"rope_type": "dynamic", "factor": 2.0})
