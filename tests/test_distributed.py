"""Two data-parallel processes (torchrun, gloo) share one lambda* equal to the single-process value on the union."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from opefo_trl.entropy_flow import entropy_flow, flow_stats


@pytest.mark.parametrize("accumulation", ["1", "2"], ids=["from_training_forward", "separate_scoring_pass"])
def test_lambda_star_is_reduced_over_ranks(tiny_model_path, tmp_path, accumulation):
    worker = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with socket.socket() as probe:  # a free port, so that parallel runs do not collide
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        port,
        worker,
        tiny_model_path,
        str(tmp_path),
        accumulation,
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2  # two rollout batches each
    for step in range(2):
        local = [ranks[r][step] for r in range(2)]
        # Both ranks saw different data but applied the same lambda*.
        assert (
            not torch.equal(local[0]["logps"], local[1]["logps"]) or local[0]["logps"].shape != local[1]["logps"].shape
        )
        assert local[0]["entropy_flow/lambda"] == local[1]["entropy_flow/lambda"]
        # One process over the union of both ranks' tokens gives the same lambda*.
        flows = [entropy_flow(b["logps"], b["entropies"], b["advantages"]) for b in local]
        union = torch.cat([f[b["mask"].bool()] for f, b in zip(flows, local, strict=True)])
        single = flow_stats(union, torch.ones_like(union)).lambda_star.item()
        assert local[0]["entropy_flow/lambda"] == pytest.approx(single, rel=1e-9, abs=1e-12)
        per_rank = [flow_stats(f, b["mask"]).lambda_star.item() for f, b in zip(flows, local, strict=True)]
        assert any(abs(p - single) > 1e-6 for p in per_rank), "a per-rank lambda* would have been the same"
