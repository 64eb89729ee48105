"""The vLLM tier's one workaround for vLLM's CPU build: every linear layer computes with its own weight.

vLLM's CPU backend prepacks each linear layer's weight for oneDNN / its own GEMM kernels after loading
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``). With ``remove_weight=True`` (every
``LinearBase`` layer) it then replaces ``layer.weight`` by an empty Parameter, so TRL's colocate weight sync
(``VLLMGeneration.sync_weights`` -> ``model.load_weights``) fails with "'Parameter' object has no attribute
'weight_loader'"; with ``remove_weight=False`` (the embedding / LM head) the weight stays but the packed copy is what
computes, so a sync would not reach the logits. vLLM 0.31 has no option or environment variable that keeps the weight
live (``VLLM_ZENTORCH_WEIGHT_PREPACK`` concerns AMD's zentorch path only), so the tier routes every 2-D GEMM through
``torch.nn.functional.linear`` on the layer's weight, vLLM's own fallback. GPU builds never take this path; the
library carries no such patch.

``install()`` patches this process; a subprocess (opefo-train, accelerate launch) runs ``python tests/vllm_cpu_gemm.py
<module> <args...>``, which patches and then runs ``<module>``'s ``main`` with the arguments.
"""

from __future__ import annotations

import runpy
import sys

import torch


def _keep_weight_dispatch(original):
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)  # not a dense GEMM: vLLM's own handling
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.opefo_keeps_weight = True  # type: ignore[attr-defined]
    return dispatch


def install() -> None:
    """Patch vLLM's CPU GEMM dispatch in this process (idempotent)."""
    from vllm.model_executor.layers import utils

    if not getattr(utils.dispatch_cpu_unquantized_gemm, "opefo_keeps_weight", False):
        utils.dispatch_cpu_unquantized_gemm = _keep_weight_dispatch(utils.dispatch_cpu_unquantized_gemm)


if __name__ == "__main__":
    install()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__")
