"""An engine for drift localisation: an nn.Module forward plus the function that turns its
logits into the log-probs it reports, and the stages its residual stream passes through.

Stages, in call order: the input embedding, each block of the model's block list (the
longest nn.ModuleList of one class: HF's `model.layers`), the modules the blocks' parent
calls after them (HF's final `norm`), and the output embedding (`lm_head`). Ops: each
block's children (depth 1: norms, attention, MLP) and their children (depth 2: the
projections, an MoE block's router and experts). A stage is kept only when its output
is a float tensor [B, L, F] (or [B * L, F]) with F the hidden or vocab size, which drops
helpers such as HF's rotary embedding.

Residual conventions (what a block hands the next one; the comparison uses the stream):
  "hf"    a block returns the residual stream itself (transformers' decoder layers)
  "vllm"  a block returns (hidden_states, residual) and the next block's fused norm adds
          them: the stream is hidden_states + residual; a block is fed the stream as
          hidden_states with residual=None, which vLLM's layers read as "residual =
          hidden_states" (vllm/model_executor/models/llama.py, LlamaDecoderLayer.forward)
Comparing the raw outputs of two conventions differs by the residual itself at every
block; comparing streams does not (nnsight #630).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.validation import check_choice

CONVENTIONS = ("hf", "vllm")


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """What vLLM reports by default and a trainer computes: log softmax of the logits, fp32."""
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class Engine:
    """module: the forward (HF causal LM, or any module called as module(input_ids=...,
    attention_mask=...) returning logits or an object with .logits). logprobs: logits
    [B, L, V] -> the log-probs this side reports. convention: "hf" or "vllm" (module doc)."""

    module: torch.nn.Module
    logprobs: Callable = raw_logprobs
    convention: str = "hf"
    name: str = "engine"

    def __post_init__(self):
        if not isinstance(self.module, torch.nn.Module):
            raise InvalidType(f"engine {self.name!r}: module={type(self.module).__name__} must be "
                              "a torch.nn.Module (an HF causal LM or your own forward)")
        check_choice(self.convention, "convention", CONVENTIONS)

    def logits(self, input_ids, attention_mask=None) -> torch.Tensor:
        kw = {} if attention_mask is None else {"attention_mask": attention_mask}
        if "use_cache" in inspect.signature(self.module.forward).parameters:
            kw["use_cache"] = False  # no KV cache: a block may be called again on its own
        out = self.module(input_ids=input_ids, **kw)
        out = getattr(out, "logits", out)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The dtype holding most of the floating parameters: the engine's nominal precision."""
        count: dict = {}
        for p in self.module.parameters():
            if p.is_floating_point():
                count[p.dtype] = count.get(p.dtype, 0) + p.numel()
        return max(count, key=count.get) if count else torch.float32


@dataclass(frozen=True)
class Stage:
    name: str            # module path, e.g. "model.layers.3"
    role: str            # embedding / block / norm / lm_head / attention / mlp / router / ...
    depth: int           # 0 a stage of the stream, 1 a block's child, 2 its grandchild
    block: int | None    # the block index it belongs to (its own for a block)


@dataclass
class Layout:
    """The stages of one engine, in call order, and the ops of each block."""

    stages: list
    ops: dict = field(default_factory=dict)     # block index -> [Stage] (depth 1 then 2)
    hidden: int = 0
    vocab: int = 0

    @property
    def names(self) -> list:
        return [s.name for s in self.stages]

    @property
    def n_blocks(self) -> int:
        return sum(s.role == "block" for s in self.stages)


def role_of(name: str, parent: str | None = None) -> str:
    """The op's role from its module name (the words HF, vLLM and Megatron use); a depth-2
    op takes its parent's role unless it is a router or a norm itself (q_proj is attention)."""
    leaf = name.split(".")[-1].lower()
    if leaf in ("gate", "router") or leaf.startswith("router"):
        return "router"
    if "norm" in leaf or leaf.startswith("ln"):
        return "norm"
    if parent is not None:
        return parent
    if leaf in ("lm_head", "output"):
        return "lm_head"
    if "embed" in leaf or leaf == "wte":
        return "embedding"
    if "attn" in leaf or "attention" in leaf:
        return "attention"
    if any(w in leaf for w in ("mlp", "moe", "ffn", "expert", "proj", "act")):
        return "mlp"
    return leaf


def _block_list(module: torch.nn.Module) -> tuple:
    best = None
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[2]:
                best = (name, m, size)
    if best is None:
        raise InvalidArgument(f"{type(module).__name__} has no nn.ModuleList of blocks: localisation "
                              "patches blocks, so the model needs its layers in one ModuleList")
    return best[0], best[1]


def first_tensor(out):
    """The tensor an output stands for: itself, the first of a tuple, or `.logits`."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


@dataclass
class Candidates:
    """What a module's structure offers, before any forward: the block list and the modules
    that may be stages (the blocks' parent's children, the output embedding), and the ops."""

    list_name: str
    n_blocks: int
    stages: list            # candidate stage names
    ops: dict               # block index -> [Stage] (depth 1 then 2)
    head: str | None = None  # the output embedding (output_head), a stage of role lm_head

    @property
    def names(self) -> list:
        return self.stages + [o.name for ops in self.ops.values() for o in ops]


def candidates(mod: torch.nn.Module) -> Candidates:
    list_name, blocks = _block_list(mod)
    parent_name = list_name.rpartition(".")[0]
    parent = mod.get_submodule(parent_name) if parent_name else mod
    prefix = parent_name + "." if parent_name else ""
    names = [f"{prefix}{n}" for n, c in parent.named_children() if c is not blocks]
    names += [f"{list_name}.{i}" for i in range(len(blocks))]
    head = output_head(mod, list_name)
    if head is not None and head not in names:
        names.append(head)
    ops = {}
    for i, b in enumerate(blocks):
        base = f"{list_name}.{i}"
        ops[i] = ([Stage(f"{base}.{n}", role_of(n), 1, i) for n, _ in b.named_children()]
                  + [Stage(f"{base}.{n}.{g}", role_of(g, role_of(n)), 2, i)
                     for n, c in b.named_children() for g, _ in c.named_children()])
    return Candidates(list_name, len(blocks), names, ops, head)


def output_head(mod: torch.nn.Module, list_name: str) -> str | None:
    """The name of the module whose output is the logits: HF's output embedding where the model
    has the accessor, else by its role in any nn.Module: the last nn.Linear outside the blocks
    whose out_features is the vocabulary (config.vocab_size, else the input embedding's rows;
    with neither known, the last nn.Linear outside the blocks that is wider than its input).
    layout_from confirms it on the traced forward: its output is as wide as the logits."""
    head = mod.get_output_embeddings() if hasattr(mod, "get_output_embeddings") else None
    if head is not None:
        return next((n for n, m in mod.named_modules() if m is head), None)
    v = getattr(getattr(mod, "config", None), "vocab_size", None)
    if not isinstance(v, int):
        emb = next((m for m in mod.modules() if isinstance(m, torch.nn.Embedding)), None)
        v = getattr(emb, "num_embeddings", None)
    inside = list_name + "."
    linears = [(n, m) for n, m in mod.named_modules() if isinstance(m, torch.nn.Linear)
               and not n.startswith(inside) and (m.out_features == v if v else m.out_features > m.in_features)]
    return linears[-1][0] if linears else None


def layout_from(c: Candidates, order: list, shapes: dict, B: int, L: int, vocab: int) -> Layout:
    """The stages in call order from one traced forward: `order` the names as their forwards
    returned, `shapes` name -> the shape of the output's first float tensor (or None)."""
    block_names = {f"{c.list_name}.{i}" for i in range(c.n_blocks)}
    hidden = next((shapes[n][-1] for n in order if n in block_names and shapes.get(n)), 0)
    stages, seen = [], set()
    for name in order:
        s = shapes.get(name)
        if name in seen or name not in c.stages or s is None or s[-1] not in (hidden, vocab) \
                or s[0] not in (B, B * L):
            continue
        seen.add(name)
        is_block = name in block_names
        idx = int(name.rsplit(".", 1)[1]) if is_block else None
        # the output embedding by what it produces: the logits' width, whatever its name
        head = not is_block and (name == c.head or s[-1] == vocab != hidden)
        stages.append(Stage(name, "block" if is_block else "lm_head" if head else role_of(name), 0, idx))
    return Layout(stages, c.ops, hidden, vocab)


def discover(engine: Engine, input_ids, attention_mask=None) -> Layout:
    """Trace one forward and return the stages in call order (module doc)."""
    c = candidates(engine.module)
    order, shapes, handles = [], {}, []
    B, L = input_ids.shape
    for name in c.stages:
        def hook(m, args, out, name=name):
            order.append(name)
            t = first_tensor(out)
            shape = None if t is None or not t.is_floating_point() else tuple(t.shape)
            prev = shapes.get(name)
            if name not in shapes or prev is None or shape is None:
                shapes.setdefault(name, shape)
            elif prev[0] not in (B, B * L) and prev[1:] == shape[1:]:
                # an engine that runs the batch in parts calls the stage once per part
                shapes[name] = (prev[0] + shape[0], *shape[1:])
        handles.append(engine.module.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = engine.logits(input_ids, attention_mask)
    finally:
        for h in handles:
            h.remove()
    return layout_from(c, order, shapes, B, L, logits.shape[-1])


def match_candidates(a: Candidates, b: Candidates, names=("trainer", "engine")) -> None:
    """Both engines must have the same blocks and stages under the same names (say which)."""
    if a.n_blocks != b.n_blocks:
        raise InvalidArgument(f"the {names[0]} has {a.n_blocks} blocks and the {names[1]} "
                              f"{b.n_blocks}: localisation compares block k with block k")
    only_a = [n for n in a.stages if n not in b.stages]
    only_b = [n for n in b.stages if n not in a.stages]
    if only_a or only_b:
        raise InvalidArgument(f"stage names differ: only in the {names[0]}: {only_a}; only in the "
                              f"{names[1]}: {only_b} (wrap one engine so its modules carry the "
                              "other's names)")
