"""Parallel transforms judged against the single-device fp64 step.

    from trainprobes.transforms import TrainingStep, FSDP2, probe
    step = TrainingStep(model=make_model, batch=make_batch, loss=loss_fn)
    result = probe(step, FSDP2(reduce_dtype="bf16"), world=2, trials=16)
    result.metrics["equivalent"], result.metrics["transform_verdict"], result.metrics["scale"]

Transforms: DDP (hooks fp16/bf16), Accumulation, FSDP2, TensorParallel, Pipeline on the real
PyTorch APIs, Custom(fn) for a user's own step in Python, and UserStep("pkg.mod") for a user's own
parallel step with its setup hook (FSDP2, DTensor TP, DDP, main_grad, plain shards), as
--step on the command line. Verdicts: exact, noise, biased,
inconsistent, wrong (trainprobes.transforms.judge). See docs/transforms.md.

Names load on first use: every rank imports this package to unpickle its work, and should
not pay for scipy and the judge it never runs.
"""
import importlib

_WHERE = {
    "NORMALIZATIONS": "base", "RankContext": "base", "StepOutput": "base", "Transform": "base",
    "Custom": "custom", "DDP": "data_parallel", "Accumulation": "data_parallel",
    "bf16_allreduce_hook": "data_parallel", "Probe": "equivalence", "probe": "equivalence",
    "run_probes": "equivalence", "PROBE": "equivalence", "full_gradients": "gather",
    "local_gradients": "gather", "EQUIVALENT": "judge", "KINDS": "judge", "Pipeline": "pipeline",
    "TRANSFORMS": "registry", "build_transform": "registry", "parse_transform": "registry",
    "FSDP2": "sharded", "TrainingStep": "step", "TensorParallel": "tensor_parallel",
    "UserStep": "user", "Partition": "readout",
    "ContextParallel": "context", "ExpertParallel": "experts",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'trainprobes.transforms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainprobes.transforms.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
