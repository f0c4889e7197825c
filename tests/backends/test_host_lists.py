"""Host-side step metadata built from Python lists (CPU)."""

from __future__ import annotations

import pytest
import torch

from encore.backends.flashinfer_backend import _row_pages, _rows
from encore.backends.host_tensors import host_tensor, upload
from encore.engine.kv_cache import DUMMY_PAGE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype, values", [(torch.int64, [3, -1, 2 ** 40]), (torch.int32, [0, 7, -5]),
                                           (torch.float32, [0.0, 0.7, 1.0])])
def test_host_tensor_holds_the_values_in_its_dtype(dtype, values):
    got = host_tensor(values, dtype)
    assert got.dtype == dtype and got.device.type == "cpu"
    assert torch.equal(got, torch.tensor(values, dtype=dtype))
    assert host_tensor([], dtype).shape == (0,) and host_tensor([], dtype).dtype == dtype


# Parts whose byte lengths are not multiples of 8 (3 int32, 1 float32), an empty one, and values that
# only int64 holds: each must land at its own aligned offset, in its own dtype.
PARTS = [([5, -7, 2 ** 40], torch.int64), ([1, 2, 3], torch.int32), ([], torch.int64), ([0.25], torch.float32),
         ([9, 8], torch.int32), ([2 ** 62, -1], torch.int64)]


def _check_parts(got: list[torch.Tensor], device: torch.device) -> None:
    assert len(got) == len(PARTS)
    for tensor, (values, dtype) in zip(got, PARTS):
        assert tensor.dtype == dtype and tensor.device.type == device.type and tensor.shape == (len(values),)
        assert tensor.cpu().tolist() == values


def test_upload_gives_each_part_in_its_dtype():
    _check_parts(upload(PARTS, torch.device("cpu")), torch.device("cpu"))


@pytest.mark.gpu
@needs_cuda
def test_upload_to_cuda_is_one_buffer_cut_into_the_parts():
    cuda = torch.device("cuda")
    got = upload(PARTS, cuda)
    torch.cuda.synchronize()
    _check_parts(got, cuda)
    storages = {t.untyped_storage().data_ptr() for t in got}
    assert len(storages) == 1  # one device buffer: one copy
    assert all(t.data_ptr() % 8 == 0 for t in got)


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


def test_flashinfer_filler_row_reads_only_the_dummy_page():
    """A static prefill plan's bucket padding (70 tokens) as a last row of 70 queries over as many keys:
    its two pages are the dummy page, after the table rows' pages; the table has no row for it."""
    rows = _rows([1, 3], [5, 130], 64, filler=70)
    assert rows.qo_indptr.tolist() == [0, 1, 4, 74] and rows.kv_indptr.tolist() == [0, 1, 4, 6]
    assert rows.kv_len.tolist() == [5, 130, 70] and (rows.table_pages, rows.num_pages) == (4, 6)
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)
    assert _row_pages(table, rows).tolist() == [1, 5, 6, 7, DUMMY_PAGE, DUMMY_PAGE]
    empty = _rows([1, 3], [5, 130], 64, filler=0)  # a full bucket: the row is there, with nothing to do
    assert empty.qo_indptr.tolist() == [0, 1, 4, 4] and _row_pages(table, empty).tolist() == [1, 5, 6, 7]


def test_flashinfer_rows_spanning_the_table_width():
    """A native re-plan reads the page table as it is: row r's pages start at r·W (W = 4 pages), the
    filler row's two dummy pages after the table's 2·W entries."""
    rows = _rows([1, 3], [5, 130], 64, filler=70, span=4)
    assert rows.qo_indptr.tolist() == [0, 1, 4, 74] and rows.kv_indptr.tolist() == [0, 4, 8, 10]
    assert rows.kv_len.tolist() == [5, 130, 70] and (rows.table_pages, rows.num_pages, rows.num_queries) == (8, 10, 74)
    plain = _rows([4, 4, 4], [1, 64, 65], 64, span=3)
    assert plain.kv_indptr.tolist() == [0, 3, 6, 9] and (plain.table_pages, plain.num_pages) == (9, 9)
