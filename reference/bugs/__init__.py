"""The zoo: faithful, tiny re-creations of published parallel-training bugs, each beside its
fixed twin, each citing the issue or PR it re-creates. Arithmetic and mechanisms only.

Every entry is a custom step (trainprobes.reference.bugs.common) with a `fixed` switch, a
model factory and a batch factory, runs on two ranks, and carries the verdict its mechanism
implies (`expected`: the buggy step's; the fixed twin's is always "equivalent", exact or
rounding noise) and, where the arithmetic gives one, the analytic scale of the error:

  entry                 source                                expected      analytic
  mean_of_means         huggingface/transformers PR #34191    biased        grad x1.25, loss x1.56
  partial_window        modelscope/ms-swift PR #10084         biased        grad and loss x0.5
  sp_layernorm          NVIDIA/Megatron-LM #1446, gpt-neox    inconsistent  -
                        PR #1257
  cp_eval_loss          huggingface/transformers PR #48167    biased        loss x2 (grads exact)
  cp_token_count        verl-project/verl #5983               biased        grad and loss x2
  dp_local_tokens       NVIDIA/Megatron-LM #7452              biased        grad x4/3, loss x1.67
  doubled_expert_grads  NVIDIA/Megatron-LM #6660              biased        experts ~x1.5
  pp_repeated_scaling   deepspeedai/DeepSpeed PR #8154        biased        stage 0 x0.25
  pipedream_staleness   PipeDream weight staleness            biased        -
                        (marin PR #6423 injects it)
  cp_loss_scaling       NVIDIA/Megatron-LM #673, #906         biased        grad x2 (cp), loss x1
  cp_mtp_loss           NVIDIA/Megatron-LM #3943, PR #3959    biased        MTP head x1/2 (1/cp)
  ep_expert_grad_scale  NVIDIA/Megatron-LM PR #5956           biased        experts x2 (ep)
  ep_lost_remote_grad   NVIDIA-NeMo/Automodel PR #1260        biased        -
The cp_ and ep_ entries run a real context-parallel attention (all-gathered keys and values)
and a real expert-parallel dispatch (all_to_all_single): trainprobes.reference.
context_parallel and .expert_parallel.

No verdicts are computed here; trainprobes.transforms judges the entries.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

from trainprobes.reference.bugs import accumulation, context, data, experts, parallel, pipeline
from trainprobes.reference.bugs import expert_parallel as ep

__all__ = ["Analytic", "Bug", "ZOO", "bug"]


class Analytic(NamedTuple):
    """The error the arithmetic implies: the whole gradient's scale, the loss's, and the
    scale of the parameters a local bug sits in (the rest are exact)."""

    scale: float | None = None
    loss_scale: float | None = None
    parameters: dict | None = None


@dataclass(frozen=True)
class Bug:
    name: str
    title: str
    source: str
    url: str
    expected: str            # the buggy step's verdict: "biased" or "inconsistent"
    where: tuple             # the parameters it sits in ("loss" for the loss alone)
    step: Callable           # step(model, batch, ctx, fixed=False) -> {"loss", "grads"}
    model: Callable
    batch: Callable          # batch(generator) -> dict
    analytic: Analytic | None = None
    world: int = 2
    loss: Callable | None = None   # the single-device loss (None: data.loss)

    @property
    def buggy(self) -> Callable:
        return functools.partial(self.step, fixed=False)

    @property
    def fixed(self) -> Callable:
        return functools.partial(self.step, fixed=True)


def _docs(layout, **kw):
    return functools.partial(data.documents, layout, **kw)


def _with_next(layout, generator):
    return context.with_next(data.documents(layout, generator))


def _equal_weights(layout, pieces) -> Analytic:
    """The gradient and loss scales of averaging `pieces` with equal weights over `layout`."""
    weights = [1 / len(pieces)] * len(pieces)
    return Analytic(*(data.normalisation_ratio(layout, pieces, weights, loss)
                      for loss in (False, True)))


_MLP = functools.partial(data.mlp)
ZOO = (
    Bug("mean_of_means", "accumulation averages micro-batch means over uneven token counts",
        "huggingface/transformers PR #34191", "https://github.com/huggingface/transformers/pull/34191",
        "biased", ("weight",), accumulation.mean_of_means, data.linear_model,
        _docs(accumulation.LAYOUT),
        _equal_weights(accumulation.LAYOUT, accumulation.PIECES)),
    Bug("partial_window", "a partial last accumulation window divided by the full window size",
        "modelscope/ms-swift PR #10084", "https://github.com/modelscope/ms-swift/pull/10084",
        "biased", ("0.weight", "0.bias", "2.weight", "2.bias"), accumulation.partial_window, _MLP,
        _docs(data.full(8, 4)),
        Analytic(accumulation.WINDOW / accumulation.CONFIGURED_STEPS,
                 accumulation.WINDOW / accumulation.CONFIGURED_STEPS)),
    Bug("sp_layernorm", "sequence-parallel LayerNorm gradients never all-reduced over TP ranks",
        "NVIDIA/Megatron-LM #1446; EleutherAI/gpt-neox PR #1257",
        "https://github.com/EleutherAI/gpt-neox/pull/1257",
        "inconsistent", ("0.weight", "0.bias"), parallel.sp_layernorm,
        functools.partial(data.mlp, norm=True), _docs(data.full(4, 8))),
    Bug("cp_eval_loss", "reported loss summed over the context-parallel group (cp x true)",
        "huggingface/transformers PR #48167", "https://github.com/huggingface/transformers/pull/48167",
        "biased", ("loss",), parallel.cp_eval_loss, _MLP, _docs(data.full(4, 8)),
        Analytic(1.0, 2.0)),
    Bug("cp_token_count", "token count reduced over DP only, missing context-parallel ranks",
        "verl-project/verl #5983", "https://github.com/verl-project/verl/pull/6049",
        "biased", ("0.weight", "0.bias", "2.weight", "2.bias"), parallel.cp_token_count, _MLP,
        _docs(data.full(4, 8)), Analytic(2.0, 2.0)),
    Bug("dp_local_tokens", "loss normalised by each rank's local token count, ranks averaged",
        "NVIDIA/Megatron-LM #7452", "https://github.com/NVIDIA/Megatron-LM/issues/7452",
        "biased", ("weight",), parallel.dp_local_tokens, data.linear_model,
        _docs(parallel.LOCAL_LAYOUT),
        _equal_weights(parallel.LOCAL_LAYOUT, parallel.LOCAL_PIECES)),
    Bug("doubled_expert_grads", "expert gradient buffer doubled at every micro-batch (EP = DP)",
        "NVIDIA/Megatron-LM #6660", "https://github.com/NVIDIA/Megatron-LM/issues/6660",
        "biased", ("experts.0.weight", "experts.0.bias", "experts.1.weight", "experts.1.bias"),
        experts.doubled_expert_grads, experts.model, _docs(data.full(8, 4))),
    Bug("pp_repeated_scaling", "accumulation scaling repeated at every pipeline stage",
        "deepspeedai/DeepSpeed PR #8154", "https://github.com/deepspeedai/DeepSpeed/pull/8154",
        "biased", ("0.weight", "0.bias"), pipeline.repeated_scaling, _MLP, _docs(data.full(8, 4)),
        Analytic(None, 1.0, {"0.weight": 1 / pipeline.GAS, "0.bias": 1 / pipeline.GAS,
                             "2.weight": 1.0, "2.bias": 1.0})),
    Bug("pipedream_staleness", "first stage's gradient computed on weights one update old",
        "PipeDream weight staleness (marin PR #6423 injects it)",
        "https://github.com/marin-community/marin/pull/6423",
        "biased", ("0.weight", "0.bias", "2.weight", "2.bias"), pipeline.stale_weights, _MLP,
        _docs(data.full(8, 4), with_previous=True)),
    Bug("cp_loss_scaling", "context-parallel loss multiplied by cp, gradients divided by dp only",
        "NVIDIA/Megatron-LM #673, #906", "https://github.com/NVIDIA/Megatron-LM/issues/906",
        "biased", ("qkv.weight", "qkv.bias", "out.weight", "out.bias", "mtp.weight", "mtp.bias"),
        context.cp_loss_scaling, context.model, functools.partial(_with_next, data.full(4, 8)),
        Analytic(2.0, 1.0), loss=context.loss),
    Bug("cp_mtp_loss", "multi-token-prediction loss gradient divided by cp once more",
        "NVIDIA/Megatron-LM #3943, PR #3959", "https://github.com/NVIDIA/Megatron-LM/pull/3959",
        "biased", ("mtp.weight", "mtp.bias"), context.cp_mtp_loss, context.model,
        functools.partial(_with_next, data.full(4, 8)),
        Analytic(None, 1.0, {"mtp.weight": 0.5, "mtp.bias": 0.5, "out.weight": 1.0, "out.bias": 1.0}),
        loss=context.loss),
    Bug("ep_expert_grad_scale", "expert gradients not divided by the expert-parallel size",
        "NVIDIA/Megatron-LM PR #5956", "https://github.com/NVIDIA/Megatron-LM/pull/5956",
        "biased", tuple(f"experts.{e}.{n}" for e in range(ep.EXPERTS) for n in ("weight", "bias")),
        ep.ep_expert_grad_scale, ep.model, _docs(data.full(8, 4)),
        Analytic(None, 1.0, {**{f"experts.{e}.{n}": 2.0 for e in range(ep.EXPERTS) for n in ("weight", "bias")},
                             "proj.weight": 1.0, "head.weight": 1.0})),
    Bug("ep_lost_remote_grad", "tokens' gradients from experts on other ranks never sent back",
        "NVIDIA-NeMo/Automodel PR #1260", "https://github.com/NVIDIA-NeMo/Automodel/pull/1260",
        "biased", ("proj.weight", "proj.bias"), ep.ep_lost_remote_grad, ep.model, _docs(data.full(8, 4)),
        Analytic(None, 1.0, {"head.weight": 1.0, "experts.0.weight": 1.0})),
)


def bug(name: str) -> Bug:
    """The zoo entry called name."""
    for b in ZOO:
        if b.name == name:
            return b
    raise KeyError(f"no zoo entry {name!r}; entries: {[b.name for b in ZOO]}")
