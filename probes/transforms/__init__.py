"""Parallel transforms judged against the single-device fp64 step.

    from trainprobes.transforms import TrainingStep, FSDP2, probe
    step = TrainingStep(model=make_model, batch=make_batch, loss=loss_fn)
    result = probe(step, FSDP2(reduce_dtype="bf16"), world=2, trials=16)
    result.metrics["equivalent"], result.metrics["transform_verdict"], result.metrics["scale"]

Transforms: DDP (hooks fp16/bf16), Accumulation, FSDP2, TensorParallel, Pipeline on the real
PyTorch APIs, and Custom(fn) for a user's own trainer. Verdicts: exact, noise, biased,
inconsistent, wrong (trainprobes.transforms.judge). See docs/transforms.md.
"""
from trainprobes.transforms.base import NORMALIZATIONS, RankContext, StepOutput, Transform
from trainprobes.transforms.custom import Custom
from trainprobes.transforms.data_parallel import DDP, Accumulation, bf16_allreduce_hook
from trainprobes.transforms.equivalence import PROBE, Probe, probe, run_probes
from trainprobes.transforms.gather import full_gradients, local_gradients
from trainprobes.transforms.judge import EQUIVALENT, KINDS
from trainprobes.transforms.pipeline import Pipeline
from trainprobes.transforms.registry import TRANSFORMS, build_transform, parse_transform
from trainprobes.transforms.sharded import FSDP2
from trainprobes.transforms.step import TrainingStep
from trainprobes.transforms.tensor_parallel import TensorParallel

__all__ = ["TrainingStep", "Probe", "probe", "run_probes", "PROBE", "KINDS", "EQUIVALENT",
           "Transform", "DDP", "Accumulation", "FSDP2", "TensorParallel", "Pipeline", "Custom",
           "NORMALIZATIONS", "RankContext", "StepOutput", "bf16_allreduce_hook", "full_gradients",
           "local_gradients", "TRANSFORMS", "build_transform", "parse_transform"]
