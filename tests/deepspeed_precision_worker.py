"""Run by tests/test_recipes_accelerate.py in a process of its own (one rank, gloo): builds a DeepSpeed engine from
each DeepSpeed config given (already processed by accelerate and transformers, as in a real launch), trains one
optimizer step of a small fp32-loaded model over the config's micro-batches, and prints, as one JSON line per config,
the dtypes the engine used for weights, micro-batch gradients, their accumulation and reduction, master weights and
AdamW states."""

import json
import os
import sys

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as torch_dist

# Training collectives go through gloo; skip the JIT build of DeepSpeed's CPU shared-memory inference kernel.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

# torch.distributed reductions and the name / position of the tensor they reduce.
REDUCTIONS = {
    "all_reduce": ("tensor", 0),
    "reduce": ("tensor", 0),
    "reduce_scatter": ("input_list", 1),
    "reduce_scatter_tensor": ("input", 1),
}
reduced_dtypes = set()
recording = [False]


def _record_dtype(name, keyword, position):
    original = getattr(torch_dist, name)

    def collective(*args, **kwargs):
        if recording[0]:
            tensor = kwargs[keyword] if keyword in kwargs else args[position]
            reduced_dtypes.add(str((tensor[0] if isinstance(tensor, list) else tensor).dtype))
        return original(*args, **kwargs)

    setattr(torch_dist, name, collective)


for _name, (_keyword, _position) in REDUCTIONS.items():  # before DeepSpeed binds any of them
    _record_dtype(_name, _keyword, _position)


def _dtypes(tensors):
    return sorted({str(t.dtype) for t in tensors})


def probe(config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))  # loaded in fp32
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the Trainer's adamw_torch, handed to DeepSpeed
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    zero = engine.optimizer
    report = {"weights": _dtypes(engine.module.parameters())}
    if hasattr(zero, "grad_partitions_flat_buffer"):  # ZeRO-3: the local shards of the weights
        report["weights"] = _dtypes(p.ds_tensor for p in engine.module.parameters())
    micro_batch_gradients = set()
    for parameter in engine.module.parameters():  # the gradient backward hands over, before any accumulation
        parameter.register_hook(lambda grad: micro_batch_gradients.add(str(grad.dtype)))
    reduced_dtypes.clear()
    for _ in range(engine.gradient_accumulation_steps()):
        inputs = torch.randn(2, 16, dtype=next(engine.module.parameters()).dtype)
        loss = engine(inputs).float().pow(2).mean()
        recording[0] = True
        engine.backward(loss)
        recording[0] = False
        if engine.is_gradient_accumulation_boundary():
            if hasattr(zero, "grad_partitions_flat_buffer"):  # ZeRO-3
                report["gradient_accumulation"] = _dtypes([zero.grad_partitions_flat_buffer])
                report["master_weights"] = _dtypes(zero.fp32_partitioned_groups_flat)
            else:  # ZeRO-1/2
                report["gradient_accumulation"] = _dtypes(
                    g
                    for grads in zero.averaged_gradients.values()
                    for g in (grads if isinstance(grads, list) else [grads])
                )
                report["master_weights"] = _dtypes(zero.single_partition_of_fp32_groups)
        engine.step()
    report["micro_batch_gradient"] = sorted(micro_batch_gradients)
    report["gradient_reduction"] = sorted(reduced_dtypes)
    states = zero.optimizer.state.values()
    report["optimizer_states"] = _dtypes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq"))
    return report


def main(config_files):
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")  # MASTER_PORT: the caller's
    deepspeed.init_distributed(dist_backend="gloo")
    for path in config_files:
        with open(path) as f:
            print(json.dumps(probe(json.load(f))), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
