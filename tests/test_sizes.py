"""course_lib.support.sizes: byte counts of tensors (each storage once) and their human form."""

from __future__ import annotations

import torch

from course_lib.support.sizes import human_bytes, storage_key, tensor_bytes


def test_human_bytes() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * 2**30) == "3.00 GiB"
    assert human_bytes(2**50) == "1024.00 TiB"


def test_tensor_bytes_counts_each_storage_once() -> None:
    a = torch.zeros(10)  # 40 bytes
    b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    assert tensor_bytes(a) == 40
    # a view counts the storage it keeps alive, and only once next to its base
    assert tensor_bytes([a, a[2:5], a.view(2, 5)]) == 40
    assert tensor_bytes(a[2:5]) == 40
    assert tensor_bytes({"exp_avg": a, "step": b, "lr": 0.1, "nested": [(b,), None]}) == 64
    assert tensor_bytes([]) == 0 and tensor_bytes(None) == 0


def test_tensor_bytes_of_an_optimizer_state() -> None:
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    params = 4 * 3 + 3
    # exp_avg and exp_avg_sq per parameter (fp32), plus a scalar step per parameter tensor
    assert tensor_bytes(opt.state) == 2 * params * 4 + 2 * 4


def test_storage_key_is_shared_by_views_only() -> None:
    a, b = torch.zeros(4), torch.zeros(4)
    assert storage_key(a) == storage_key(a[1:]) == storage_key(a.view(2, 2))
    assert storage_key(a) != storage_key(b)
