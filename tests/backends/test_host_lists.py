"""Host-side step metadata built from Python lists (CPU)."""

from __future__ import annotations

import pytest
import torch

from encore.backends.flashinfer_backend import _row_pages, _rows
from encore.backends.host_tensors import host_tensor


@pytest.mark.parametrize("dtype, values", [(torch.int64, [3, -1, 2 ** 40]), (torch.int32, [0, 7, -5]),
                                           (torch.float32, [0.0, 0.7, 1.0])])
def test_host_tensor_holds_the_values_in_its_dtype(dtype, values):
    got = host_tensor(values, dtype)
    assert got.dtype == dtype and got.device.type == "cpu"
    assert torch.equal(got, torch.tensor(values, dtype=dtype))
    assert host_tensor([], dtype).shape == (0,) and host_tensor([], dtype).dtype == dtype


def test_flashinfer_rows_are_csr_over_the_page_table():
    """Two rows (1 and 3 queries, 5 and 130 keys, pages of 64, a table 4 pages wide): one page of row 0,
    then three of row 1, gathered from the table (here holding each entry's flattened index)."""
    rows = _rows([1, 3], [5, 130], 64)
    assert rows.qo_indptr.tolist() == [0, 1, 4] and rows.qo_indptr.dtype == torch.int32
    assert rows.kv_indptr.tolist() == [0, 1, 4] and rows.kv_indptr.dtype == torch.int32
    assert rows.kv_len.tolist() == [5, 130] and rows.kv_len.dtype == torch.int32
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    pages = _row_pages(table, rows)
    assert pages.tolist() == [0, 4, 5, 6] and pages.dtype == torch.int32 and rows.num_pages == 4
