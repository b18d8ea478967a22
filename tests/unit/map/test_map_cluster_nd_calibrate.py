"""MAP §4.2's per-axis all-reduce measurement (calibration.cluster.measure_axes) on real gloo ranks,
and its entries read back by the planner (planners.map.cluster_file) as the axes' prices."""
from __future__ import annotations

import pytest

from calibration.cluster import measure_axes
from planners.map.cluster_file import check_cluster, cluster_mesh

# 4 KiB to 16 MiB: the largest moves ~4,000x the bytes, so even the fastest of its repetitions
# outlasts the smallest's on a loaded 2-core CI box (4 KiB..1 MiB failed that once: each size's
# minimum is ~0.1 ms apart there, within one preemption)
SIZES = (4 << 10, 1 << 20, 16 << 20)


@pytest.mark.slow
def test_axis_allreduce_is_measured_on_gloo_ranks_and_prices_the_mesh():
    shape, order = (2, 2), (0, 1, 2, 3)
    axes = measure_axes(shape, order, quick=True, backend="gloo", sizes=SIZES)
    assert [a["axis"] for a in axes] == [0, 1]
    for a in axes:
        assert len(a["lines"]) == 2 and all(len(line["seconds"]) == len(SIZES) for line in a["lines"])
        # larger all-reduces take longer on every line (a real measurement, not a constant)
        assert all(line["seconds"][-1] > line["seconds"][0] for line in a["lines"])
        assert a["busbw_bytes_per_s"] == min(line["busbw_bytes_per_s"] for line in a["lines"]) > 0
    # a file with these entries is accepted and its axes priced by them, not by the pairs
    pairs = [[0.0 if i == j else 1e9 for j in range(4)] for i in range(4)]
    data = check_cluster({"devices": list(order), "beta_bytes_per_s": pairs,
                          "alpha_s": [[0.0] * 4 for _ in range(4)], "axis_allreduce": axes})
    found = cluster_mesh(data, order, shape)
    assert [ax.beta_bytes_per_s for ax in found.mesh.axes] == [a["busbw_bytes_per_s"] for a in axes]
    assert [ax.alpha_s for ax in found.mesh.axes] == [a["alpha_s"] for a in axes]
