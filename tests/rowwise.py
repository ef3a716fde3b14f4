"""The batch-invariance check every row-wise kernel's tests share."""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW_COUNTS = (1, 3, 12, 17, 40)  # a plain step, verifies, past a 16- and a 32-row piece


def assert_rows_bitwise_the_same(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Each row of `linear(x[:rows])` equals that row computed alone, at 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(row) for row in x.split(1)])
        for thread_count in (1, 2):
            torch.set_num_threads(thread_count)
            for rows in ROW_COUNTS:
                assert torch.equal(linear(x[:rows]), alone[:rows]), (thread_count, rows)
    finally:
        torch.set_num_threads(threads)
