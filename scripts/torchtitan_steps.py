"""torchtitan's own Llama3 and its own `parallelize_llama`, as a trainprobes user step
(scripts/torchtitan_check.py runs it; the ranks import this module by name).

The single-device step (`single`): torchtitan 0.3.0's `Llama3Model` built from a shrunk
config made with torchtitan's own helpers (`_build_llama3_layers`: same blocks, fused QKV,
RMSNorm, SwiGLU, RoPE; dim 32, 4 heads, 2 layers, vocabulary 64, sequences of 8), its
weights from torchtitan's `init_states` under a fixed seed; a batch of token ids with
next-token labels; the loss torchtitan's trainer computes: the summed cross-entropy over
the global count of valid tokens.

The parallel step (`setup`, `step`): `ParallelDims` and `parallelize_llama` exactly as
torchtitan's trainer calls them, with the degrees and mixed precision of the named setup
(`fsdp`: dp 2; `tp`: tp 2; `fsdp_tp`: 2 x 2; `*_bf16_reduce`: reduce_dtype bfloat16); then torchtitan's
forward, its loss normalisation (local summed loss / global valid tokens, FSDP2's own
division disabled by torchtitan) and backward. Gradients stay where torchtitan keeps them
(DTensors); the probe reads them.

What it takes to run on a CPU with gloo (each a fact of torchtitan 0.3.0 + torch 2.13):
  1. `torchtitan.distributed.minimal_async_ep.kernels` imports triton (MoE kernels a
     dense Llama never calls): a stub module stands in for it, not for triton;
  2. `parallel_dims.device_type` is "cuda": set to "cpu" before the mesh is built;
  3. FlexAttention has no CPU backward: each layer's `inner_attention` is
     ScaledDotProductAttention (causal), the same attention on rows of one document;
  4. FSDP2 with division disabled reduces with ReduceOp.PREMUL_SUM, which gloo lacks:
     `set_force_sum_reduction_for_comms(True)` on each FSDP module (a plain SUM; the
     division torchtitan disabled is 1 either way);
  5. the default spmd_backend "spmd_types" needs an FSDP2 torch 2.13 lacks:
     "partial_dtensor" (DTensor on the model-parallel axes only).
"""
from __future__ import annotations

import functools
import sys
import tempfile
import types

import torch

DIM, HEADS, LAYERS, VOCAB, SEQ, BATCH = 32, 4, 2, 64, 8, 8


def _stub_triton_kernels() -> None:
    """Step 1: the MoE kernels module, never called by a dense Llama, as an empty stand-in."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def kernel(*a, **k):
            raise RuntimeError(f"{name}.{attr} needs triton (a CUDA MoE kernel)")
        return kernel
    stub.__getattr__ = missing
    sys.modules[name] = stub


def config():
    """The shrunk Llama3 config, from torchtitan's own builders (step 3: SDPA attention)."""
    _stub_triton_kernels()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="none"),
        attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers)
    # what the trainer's update_from_config does: the TP plan (sequence parallel on, its
    # default), declared on the config and applied only where the mesh has a tp axis
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg


def model():
    """torchtitan's Llama3Model, weights from its own init under seed 0."""
    cfg = config()
    torch.manual_seed(0)
    m = cfg.build()
    m.init_states(buffer_device=torch.device("cpu"))
    return m


def batch(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"input": ids[:, :-1], "labels": ids[:, 1:]}


def loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                                             reduction="sum")


def loss(logits, b):
    return loss_sum(logits, b["labels"]) / b["labels"].numel()


def tokens(b):
    return b["labels"].numel()


def single():
    from trainprobes.transforms import TrainingStep
    return TrainingStep(model=model, batch=batch, loss=loss, tokens=tokens, name="torchtitan.llama3")


# -- the parallel step: torchtitan's parallelize_llama ------------------------------------
def setup(model, ctx, dp=1, tp=1, param="float32", reduce="float32"):
    _stub_triton_kernels()
    import torchtitan.distributed.parallel_dims as pd
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama
    pd.device_type = "cpu"                                                    # step 2
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                                    spmd_backend="partial_dtensor")          # step 5
    dims = pd.ParallelDims.from_config(parallelism, ctx.world)
    dims.build_mesh()
    training = TrainingConfig(local_batch_size=BATCH // dp, seq_len=SEQ,
                              mixed_precision_param=param, mixed_precision_reduce=reduce)
    # the trainer's own call (torchtitan/trainer.py, before its loss is built): the loss and
    # the DTensor helpers read the backend from here, not from the ParallelismConfig
    from torchtitan.distributed import utils as dist_utils
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir())
    for m in model.modules():                                                 # step 4
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model._tt_dims = dims
    # the trainer's loss: config.loss.build(compile_config=...), torchtitan's CrossEntropyLoss
    # (summed; vocab-parallel on logits sharded over the vocabulary, as TP leaves them)
    from torchtitan.components.loss import CrossEntropyLoss
    model._tt_loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(compile_config=CompileConfig())


fsdp = functools.partial(setup, dp=2)
tp = functools.partial(setup, tp=2)
fsdp_tp = functools.partial(setup, dp=2, tp=2)
fsdp_bf16_reduce = functools.partial(setup, dp=2, reduce="bfloat16")
fsdp_tp_bf16_reduce = functools.partial(setup, dp=2, tp=2, reduce="bfloat16")


def step(model, b, ctx):
    """torchtitan's forward_backward_step on this rank's share of the batch (the data-
    parallel rank's rows; every tensor-parallel rank of it the same rows)."""
    import torch.distributed as dist
    dims = model._tt_dims
    dp_rank = dims.get_mesh("fsdp").get_local_rank() if dims.dp_shard_enabled else 0
    dp = dims.dp_shard if dims.dp_shard_enabled else 1
    n = b["input"].shape[0] // dp
    ids, labels = b["input"][dp_rank * n:(dp_rank + 1) * n], b["labels"][dp_rank * n:(dp_rank + 1) * n]
    global_tokens = torch.tensor(float(labels.numel()))
    if dims.dp_enabled:
        dist.all_reduce(global_tokens, group=dims.get_mesh("fsdp").get_group())
    pred = model(ids)
    total, _ = model._tt_loss(pred, labels, global_tokens)  # local sum / global valid tokens
    total.backward()
    return _logged(total, dims)


def _logged(loss, dims):
    """The loss torchtitan logs: the data-parallel ranks' shares summed."""
    import torch.distributed as dist
    out = loss.detach().clone()
    if dims.dp_enabled:
        dist.all_reduce(out, group=dims.get_mesh("fsdp").get_group())
    return out


def step_local_tokens(model, b, ctx):
    """The bug (verl #5983's kind): each data-parallel rank divides its summed loss by its
    own token count, FSDP2's division still disabled: every gradient x dp."""
    dims = model._tt_dims
    dp_rank = dims.get_mesh("fsdp").get_local_rank() if dims.dp_shard_enabled else 0
    n = b["input"].shape[0] // (dims.dp_shard if dims.dp_shard_enabled else 1)
    ids, labels = b["input"][dp_rank * n:(dp_rank + 1) * n], b["labels"][dp_rank * n:(dp_rank + 1) * n]
    pred = model(ids)
    total, _ = model._tt_loss(pred, labels, torch.tensor(float(labels.numel())))
    total.backward()
    return _logged(total, dims)
