"""``benchmarks.ops``' second compaction yardstick: the cache lines the moves must read."""

import torch

from benchmarks.ops import read_lines
from vllm_contour.ops.cpu_layout import PageLayout


def _lines(offsets, dtype=torch.float32, page=4):
    kv = torch.zeros(3, 3, 32, 128, dtype=dtype)  # blocks x heads x bs x 2D (D = 64)
    off = torch.tensor(offsets, dtype=torch.int64)
    return read_lines(kv, PageLayout.key_transposed(32, 64), torch.full_like(off, page), off) // 64


def test_keys_by_column_and_values_by_row():
    """Keys [D, bs]: a token's key is one word in each of 64 columns of 32 tokens (two 64-byte lines a
    column in fp32, one in bf16); its value is one row of 64 elements."""
    assert _lines([0]) == 64 + 4
    assert _lines([0, 15]) == 64 + 8  # the same line of every column
    assert _lines([0, 16]) == 128 + 8  # the column's second line
    assert _lines([0, 16], torch.bfloat16) == 64 + 4  # a bf16 column is one line; a bf16 value row 2 lines


def test_lines_of_other_head_pages_are_their_own():
    kv = torch.zeros(3, 3, 32, 128)
    lay = PageLayout.key_transposed(32, 64)
    one = read_lines(kv, lay, torch.tensor([4]), torch.tensor([0]))
    assert read_lines(kv, lay, torch.tensor([4, 5]), torch.tensor([0, 0])) == 2 * one


def test_amx_packing_groups_of_tokens():
    """vLLM's AMX bf16 packing: keys in groups of 16 tokens x a pair of dims (one line per pair), values in
    runs of 2 tokens x 16 dims (one line per run)."""
    kv = torch.zeros(3, 3, 32, 128, dtype=torch.bfloat16)
    lay = PageLayout.amx_bf16(32, 64)

    def lines(offsets):
        off = torch.tensor(offsets, dtype=torch.int64)
        return read_lines(kv, lay, torch.full_like(off, 4), off) // 64

    assert lines([0]) == lines([0, 1]) == 32 + 4
    assert lines([0, 2]) == 32 + 8
    assert lines([0, 16]) == 64 + 8
