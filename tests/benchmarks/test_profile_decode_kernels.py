"""benchmarks/profile_decode_kernels.py's charging of kernels to the critical path, on made-up timelines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from profile_decode_kernels import IDLE, attribute, critical_path, differences, kernel_family, step_timeline  # noqa: E402


def test_a_kernel_under_another_is_charged_only_past_its_end():
    # a: 0-10; b starts under a (a programmatic dependent) and ends at 12; c ends under b; d after a gap.
    rows = critical_path([("d", 20.0, 5.0), ("a", 0.0, 10.0), ("c", 4.0, 6.0), ("b", 2.0, 10.0)])
    assert [r[0] for r in rows] == ["a", "b", "c", "d"]
    assert [r[3] for r in rows] == [10.0, 2.0, 0.0, 5.0]  # shares
    assert [r[4] for r in rows] == [0.0, 0.0, 0.0, 8.0]  # idle before: 12 -> 20


def test_shares_and_idle_add_up_to_the_span():
    kernels = [("gemv", 0.0, 3.0), ("split", 2.5, 4.0), ("merge", 6.0, 1.0), ("gemv", 8.0, 3.0), ("split", 10.0, 4.0)]
    rows = critical_path(kernels)
    span = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    assert sum(r[3] + r[4] for r in rows) == pytest.approx(span)


def test_attribute_groups_by_name_per_step():
    kernels = [("gemv", 0.0, 3.0), ("split", 2.5, 4.0), ("gemv", 10.0, 3.0), ("split", 12.0, 5.0)]
    rows = {r["kernel"]: r for r in attribute(critical_path(kernels), steps=2)}
    assert rows["gemv"]["launches_per_step"] == 1 and rows["gemv"]["share_us_per_step"] == 3.0
    assert rows["split"]["median_us"] == 4.5 and rows["split"]["share_us_per_step"] == (3.5 + 4.0) / 2
    assert rows[IDLE]["share_us_per_step"] == (10.0 - 6.5) / 2 and rows[IDLE]["launches_per_step"] == 0.5
    assert list(rows) == sorted(rows, key=lambda k: rows[k]["share_us_per_step"], reverse=True)


def test_step_timeline_is_one_steps_kernels_from_its_start():
    kernels = [("gemv", 0.0, 3.0), ("split", 2.5, 4.0), ("gemv", 10.0, 3.0), ("split", 14.0, 5.0)]
    second = step_timeline(critical_path(kernels), steps=2, step=1)
    assert [(r["kernel"], r["start_us"], r["share_us"], r["idle_before_us"]) for r in second] == [
        ("gemv", 0.0, 3.0, 3.5), ("split", 4.0, 5.0, 1.0)]
    with pytest.raises(ValueError, match="3 kernels in 2 steps"):
        step_timeline(critical_path(kernels[:3]), steps=2, step=0)


def test_differences_join_two_tables_by_kernel_largest_increase_first():
    decode = attribute(critical_path([("gemv", 0.0, 3.0), ("moe", 3.0, 10.0), ("cast", 13.0, 1.0)]), steps=1)
    verify = attribute(critical_path([("gemv", 0.0, 4.0), ("moe", 4.0, 16.0), ("gemm", 20.0, 2.0)]), steps=1)
    rows = {r["kernel"]: r for r in differences(decode, verify)}
    assert [r["kernel"] for r in differences(decode, verify)][:2] == ["moe", "gemm"]
    assert (rows["moe"]["share_us_before"], rows["moe"]["share_us_after"], rows["moe"]["delta_us"]) == (10.0, 16.0, 6.0)
    assert rows["cast"]["share_us_after"] == 0.0 and rows["cast"]["delta_us"] == -1.0  # only in the decode step
    assert rows["gemm"]["launches_before"] == 0.0 and rows["gemm"]["launches_after"] == 1


def test_differences_by_family_sum_the_kernels_a_shape_renames():
    decode = attribute(critical_path([("nvjet_sm90_tst_24x64_TNN", 0.0, 3.0), ("void mla<false, 64u>(P)", 3.0, 10.0),
                                      ("_down_kernel", 13.0, 2.0)]), steps=1)
    verify = attribute(critical_path([("nvjet_sm90_tst_64x64_TNT", 0.0, 4.0), ("nvjet_sm90_tst_112x64_TNN", 4.0, 1.0),
                                      ("void mla<true, 64u>(P)", 5.0, 12.0), ("_down_kernel", 17.0, 3.0)]), steps=1)
    rows = {r["kernel"]: r for r in differences(decode, verify, key=kernel_family)}
    assert set(rows) == {"cuBLAS GEMMs (nvjet_*)", "void mla", "_down_kernel", IDLE}
    gemms = rows["cuBLAS GEMMs (nvjet_*)"]
    assert (gemms["launches_before"], gemms["launches_after"], gemms["delta_us"]) == (1.0, 2.0, 2.0)
    assert (rows["void mla"]["share_us_before"], rows["void mla"]["share_us_after"]) == (10.0, 12.0)
    assert rows["_down_kernel"]["delta_us"] == 1.0
