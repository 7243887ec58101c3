"""Routing's local half, checked on CPU (the exchanges run in the 2- and 4-rank tests)."""

from __future__ import annotations

import pytest
import torch

from freescale_balance import JaggedTensor
from freescale_embed import TableConfig
from freescale_embed.routing import build_request, host_ids
from freescale_embed.sharding import RowShard

SHARDS = [
    RowShard(TableConfig("items", 10, 4, ["history", "candidates"]), world_size=2, rank=0),
    RowShard(TableConfig("tiny", 3, 4, ["flag"]), world_size=2, rank=0),
]


def _features(device: str) -> dict[str, JaggedTensor]:
    def feature(ids: list[int]) -> JaggedTensor:
        values = torch.tensor(ids, dtype=torch.int32, device=device)
        return JaggedTensor(values, torch.tensor([len(ids)], device=device))

    return {
        "history": feature([7, 1, 7]),
        "candidates": feature([9]),
        "flag": feature([2, 0]),
        "unread": feature([5]),
    }


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_host_ids_are_every_table_feature_as_int64_on_the_host(device):
    ids = host_ids(_features(device), SHARDS)
    assert list(ids) == ["history", "candidates", "flag"]  # a feature no table reads is left out
    assert all(t.device.type == "cpu" and t.dtype == torch.int64 for t in ids.values())
    assert [t.tolist() for t in ids.values()] == [[7, 1, 7], [9], [2, 0]]


def test_a_request_groups_the_unique_ids_of_a_table_by_owner():
    request = build_request(host_ids(_features("cpu"), SHARDS), SHARDS, torch.device("cpu"))
    assert [u.tolist() for u in request.unique] == [[1, 7, 9], [0, 2]]
    # The table's features concatenated in its feature order: 7, 1, 7, then 9.
    assert request.inverse[0].tolist() == [1, 0, 1, 2]
    # Rows 0-4 of "items" live on rank 0, 5-9 on rank 1; "tiny" has 2 rows per rank.
    assert request.host_counts == [[1, 1], [2, 1]]
    assert request.occurrences == {"history": 3, "candidates": 1, "flag": 2}
    assert request.max_occurrences == [2, 1]
