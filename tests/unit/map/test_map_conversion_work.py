"""Issue 26: a layout conversion's bytes live while it runs (costs.map_layout.step_work_bytes): an
all-gather holds two gathered-size buffers at once (torch's all_gather_into_tensor staging plus its
autograd wrap or, off dim 0, the cat output; executor.memtrack on hf_gpt2), a slice only its shard.
The MAP simulator's o_fcomm / o_bcomm take it (simulator.sharded_layer._Sums.redistribute)."""
from __future__ import annotations

from costs.map_layout import convert
from specs.sharding import Mesh, MeshAxis

SHAPE = (8, 12, 16)
MESH = Mesh((MeshAxis(2, 1e-5, 1e11), MeshAxis(4, 2e-5, 2.5e10)))
FULL = 8 * 12 * 16 * 4


def test_gather_holds_two_gathered_buffers():
    for src in ("S0RR", "RS0R"):
        conv = convert(src, "RRR", SHAPE, 4, MESH)
        assert [st.op for st in conv.steps] == ["all_gather"]
        assert conv.peak_bytes == FULL and conv.work_bytes == 2 * FULL


def test_a_free_slice_allocates_only_its_shard():
    conv = convert("RRR", "RS1R", SHAPE, 4, MESH)
    assert [st.op for st in conv.steps] == ["shard"]
    assert conv.work_bytes == FULL // 4


def test_two_step_path_takes_its_largest_step():
    conv = convert("S01RR", "RRR", SHAPE, 4, MESH)      # gather axis 1 (to 1/2), then axis 0 (to full)
    assert [st.op for st in conv.steps] == ["all_gather", "all_gather"]
    assert conv.work_bytes == 2 * FULL
