"""SASRec trained by FreeScale's TrainPipeline equals the same model trained by TorchRec 1.8.

FreeScale: ``TrainPipeline`` in sync mode, no balancer, Gloo, a row-wise sharded
``ShardedEmbeddingCollection``. TorchRec: ``DistributedModelParallel`` with a row-wise sharded
``EmbeddingCollection`` (fused FBGEMM optimizer of the same update) and its
``TrainPipelineSparseDist`` on the CPU; SASRec is built over an adapter that hands it TorchRec's
lookup (``benchmarks/train_torchrec.py`` holds both runs, shared with the benchmark). Same data,
same dense weights (seeded, then loaded), same initial rows.

Tolerance: the first step's losses are compared bitwise (same weights, same rows, same forward), and
so are the dense weights after it: the dense gradients agree bitwise (TorchRec's averaging over
ranks of a loss scaled by the world size is FreeScale's sum, exactly, for a power-of-two world).
What differs is the fused row update: FBGEMM sums a row's gradients over duplicate IDs in another
order than FreeScale, so the tables move apart by float32 rounding (a few ulps per step; the
TorchRec comparison of ``test_torchrec.py`` sees the same), and the losses of later steps with them.
Over these 6 steps the per-sample losses differ by about 2e-7 relative (a couple of float32 ulps);
the bound ``rtol=1e-5, atol=1e-6`` (as in the pipeline tests) leaves a wide margin for other CPUs'
kernels while a semantic mismatch (gradients off by the world size, another eps, a missed update)
moves the loss by 1e-3 or more. Both table optimizers run: row-wise Adagrad is all but blind to a
constant factor on the gradients (only eps sees it), SGD is not — with TorchRec's gradient division
switched off (embedding gradients twice FreeScale's), the SGD case's losses differ by 2e-3 at the
second step and 1e-2 after (Adagrad's by 3e-7). Dense weights after training are compared except the
attention's key bias: its gradient is zero up to rounding noise (softmax ignores a per-query
constant), which Adam's normalised step turns into moves of order ``lr`` on either side — no loss
depends on it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec", reason="the TorchRec comparison needs torchrec + fbgemm-gpu-cpu")

from benchmarks import train_torchrec  # imports torchrec at module level

_CLOSE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_sasrec_losses_equal_torchrec_train_pipeline_sparse_dist(local_groups, optimizer):
    config = train_torchrec.CompareConfig(
        steps=6, global_batch=8, max_history=32, dim=16, optimizer=optimizer
    )
    results = local_groups.get(2).run(train_torchrec.compare_rank, config, timeout_s=240)
    for result in results:
        # TorchRec's pipeline took the EmbeddingCollection's input dist out of the forward.
        assert result["pipelined"] == ["ec"]
        assert result["seeded_dense_same"]
        ours, theirs = result["freescale"], result["torchrec"]
        assert len(ours["losses"]) == len(theirs["losses"]) == config.steps
        # FreeScale's reported loss is the global sum of per-sample losses over the global
        # weight (the same float64 sum of the ranks' float32 sums).
        assert ours["losses"] == ours["losses_from_local_sums"]
        assert ours["losses"][0] == theirs["losses"][0]
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), **_CLOSE
        )
        samples = result["sample_losses"]
        assert torch.equal(samples["freescale"][0], samples["torchrec"][0])
        assert result["dense_equal_after_first_step"]  # bitwise: the same dense gradients
        for step, (a, b) in enumerate(zip(samples["freescale"], samples["torchrec"], strict=True)):
            torch.testing.assert_close(a, b, **_CLOSE, msg=lambda m, s=step: f"step {s}: {m}")
        assert result["max_table_change"] > 1e-3  # the rows trained
        assert result["max_table_diff"] < 1e-6
        assert result["max_dense_diff_but_key_bias"] < 1e-5
        for times in ours["step_s"] + theirs["step_s"]:  # one list per round
            assert len(times) == config.steps and min(times) > 0
    assert results[0]["freescale"]["losses"] == results[1]["freescale"]["losses"]
    assert results[0]["torchrec"]["losses"] == results[1]["torchrec"]["losses"]
