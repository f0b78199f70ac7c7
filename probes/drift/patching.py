"""Forward hooks that record, patch, jitter and replay stages of an engine (one code path
for every run of trainprobes.drift.localize).

record   each watched module's patchable inputs, its output stream and, for a router, the
         experts it chose, per call.
patch    each watched module is fed the inputs another engine recorded (cast to this
         engine's dtype): its output is then only what this module adds on its own.
jitter   each watched module is fed its own recorded inputs, each element times (1 + u d),
         d uniform in [-1, 1], and its output is jittered the same way: what one rounding
         at the nominal precision u does, the floor that rounding noise cannot go below.
replay   a router's expert choices are replaced by the recorded ones; its weights are
         the engine's own probabilities at those experts, renormalised or not as the router
         was MEASURED to do on that very call (router_weights: the weights it returned
         against softmax top-k, renormalised and not); a router that matches neither is
         cannot judge, never guessed from an attribute (transformers 5's Mixtral router
         always renormalises and has no norm_topk_prob).
rows     a different batch composition: recorded tensors with B rows (or B * L token
         rows) are taken at these rows, so the same tokens run beside other companions.
hand-off (patch and jitter, with hand_off=True) each watched module's output is replaced, once
         recorded, by the source's output (jittered: its own, jittered), and the float inputs
         each module is actually called with, before they are patched, are recorded: what the
         code BETWEEN two modules (the parent's forward: an embedding scale, GPT-2's
         position embedding added, a final residual add) makes of the source's output, so
         a fault there is measured on its own (trainprobes.drift.localize's hand-off rows).

hooks    a stage is what its module does together with the engine's own hooks on it: the
         recording pre-hook runs before every pre-hook the engine put there (prepend) and
         the recording hook after every hook it put there, so a cast done in the engine's
         pre-hook (inputs quantised on the way in) is measured at the module.

A block recorded for a call on its own keeps the autocast state it ran under (a model whose
forward enters torch.autocast runs its blocks' GEMMs in bf16; the block called alone,
outside that forward, would run them in fp32 and its ops would look exact): `autocast`
re-enters it.

Patchable inputs: every tensor argument except masks, positions, rotary tables and caches,
which each engine builds its own way (an eager mask and an sdpa mask differ in form, not
in meaning).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
from trainprobes.drift.engines import first_tensor
from trainprobes.errors import CannotJudge, InvalidArgument

KEEP_OWN = frozenset({"attention_mask", "position_embeddings", "position_ids", "positions",
                      "cache_position", "past_key_values", "past_key_value", "cache", "use_cache",
                      "kwargs"})


@dataclass
class Call:
    inputs: dict                  # parameter name -> tensor (patchable ones)
    out: torch.Tensor             # the output stream
    indices: torch.Tensor | None  # a router's chosen experts [N, k]
    probs: torch.Tensor | None    # a router's probabilities [N, E] (fp32)
    full: tuple | None = None     # (args, kwargs) as called: a block, to be called again alone
    autocast: tuple = ()          # ((device type, dtype), ...) autocast on when it was called


@dataclass
class Hooks:
    """Hooks on `modules` (name -> module) of one engine; `mode` is record / patch / jitter."""

    modules: dict
    mode: str = "record"
    source: dict | None = None    # name -> [Call] recorded elsewhere (patch, jitter, replay)
    convention: str = "hf"
    blocks: frozenset = frozenset()
    replay: dict | None = None    # router name -> module, replayed from `source`
    rows: torch.Tensor | None = None
    shape: tuple = (0, 0)         # (B, L) of the recorded run
    u: float = 0.0
    seed: int = 0
    hand_off: bool = False        # replace outputs and record the actual inputs (module doc)
    calls: dict = field(default_factory=dict)
    _count: dict = field(default_factory=dict)
    _handles: list = field(default_factory=list)
    _pending: dict = field(default_factory=dict)
    order: list = field(default_factory=list)   # names in the order their forwards returned
    _sigs: dict = field(default_factory=dict)
    _buf: dict = field(default_factory=dict)      # (dtype, side) -> jitter draws (_draws)

    def __enter__(self):
        self._gen = torch.Generator().manual_seed(self.seed)
        for name, m in self.modules.items():
            self.calls[name] = []
            # first of the pre-hooks, last of the hooks: a cast the engine does in its own
            # hook on a module (an lm_head run on bf16 inputs) is that module's, not the
            # hand-off's before it (module doc: hooks)
            self._handles.append(m.register_forward_pre_hook(
                lambda m, a, k, name=name: self._pre(name, m, a, k), with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(
                lambda m, a, o, name=name: self._post(name, m, o)))
        for name, m in (self.replay or {}).items():
            self._handles.append(m.register_forward_hook(
                lambda m, a, o, name=name: self._replay(name, m, o)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_forward(self, rows=None):
        """Before each forward call: reset the call counters; rows: the batch rows it holds."""
        self._count = {}
        self.rows = rows

    # --- helpers ---------------------------------------------------------------------------
    def take(self, t: torch.Tensor) -> torch.Tensor:
        return take_rows(t, self.rows, self.shape)

    def _noise(self, t: torch.Tensor, side: str) -> torch.Tensor:
        # t (1 + u d) rounded to t's dtype: computed as t + t (u d) in fp32 (fp64 for fp64
        # tensors), whose product rounds at 2^-24 of a term already below u |t|, so the final
        # rounding to t's dtype is the one that counts (and half the cost of fp64)
        work = torch.float64 if t.dtype == torch.float64 else torch.float32
        w = t.to(work)
        return w.addcmul(w, self._draws(t.numel(), work, side).view(t.shape)).to(t.dtype)

    def _draws(self, n: int, dtype: torch.dtype, side: str) -> torch.Tensor:
        """n values u d, d uniform in [-1, 1]: one seeded draw per run and side ("in" for a
        stage's inputs, "out" for its output: independent, as two roundings are), grown when a
        larger tensor comes, each tensor taking its first n (every stage's floor is judged on
        its own, so stages may share the pattern; drawing per tensor cost a tenth of a forward)."""
        have = self._buf.get((dtype, side))
        if have is None or have.numel() < n:
            have = torch.rand(n, generator=self._gen, dtype=dtype).mul_(2 * self.u).sub_(self.u)
            self._buf[(dtype, side)] = have
        return have[:n]

    def _source_call(self, name: str) -> Call:
        i = self._count.get(name, 0)
        self._count[name] = i + 1
        rec = (self.source or {}).get(name, [])
        if i >= len(rec):
            raise InvalidArgument(f"{name!r} was called {i + 1} times here but {len(rec)} times in "
                                  "the recorded run: the engines do not run the same modules")
        return rec[i]

    # --- hooks -----------------------------------------------------------------------------
    def _pre(self, name, m, args, kwargs):
        bound = _bind(m, args, kwargs, self._sigs)
        if self.mode == "record":
            ins = {k: v.detach() for k, v in bound.arguments.items()
                   if isinstance(v, torch.Tensor) and k not in KEEP_OWN}
            if self.convention == "vllm" and name in self.blocks:
                r = bound.arguments.get("residual")
                if isinstance(r, torch.Tensor):  # the stream is hidden + residual
                    ins["hidden_states"] = ins["hidden_states"] + r.detach()
                ins.pop("residual", None)
            full = (args, kwargs) if name in self.blocks else None
            self._pending.setdefault(name, []).append((ins, full, autocast_state()))
            return None
        src = self._source_call(name)
        actual = {}
        if self.hand_off:  # what the code before this module made of the source's outputs
            actual = {k: v.detach() for k, v in bound.arguments.items()
                      if k in src.inputs and isinstance(v, torch.Tensor) and v.is_floating_point()}
            r = bound.arguments.get("residual")
            if self.convention == "vllm" and name in self.blocks and isinstance(r, torch.Tensor) \
                    and "hidden_states" in actual:
                actual["hidden_states"] = actual["hidden_states"] + r.detach()
        self._pending.setdefault(name, []).append((actual, src, ()))
        for k, v in src.inputs.items():
            if k not in bound.arguments and k in _params(m, self._sigs):
                bound.arguments[k] = v
            cur = bound.arguments.get(k)
            if not isinstance(cur, torch.Tensor):
                continue
            new = self.take(v)
            if self.mode == "jitter" and new.is_floating_point():
                new = self._noise(new, "in")
            if new.shape != cur.shape:
                split = (cur.ndim and new.ndim and cur.shape[0] < new.shape[0] and cur.shape[1:] == new.shape[1:])
                raise InvalidArgument(f"{name}: input {k!r} has shape {tuple(cur.shape)} here and "
                                      f"{tuple(new.shape)} in the other engine"
                                      + (f" (this engine runs the batch in parts of {cur.shape[0]} rows: localise "
                                         "on a batch it runs in one call, or make it run the whole batch)"
                                         if split else ""))
            bound.arguments[k] = new.to(cur.dtype) if cur.is_floating_point() else new
        if self.convention == "vllm" and name in self.blocks and "residual" in bound.arguments:
            bound.arguments["residual"] = None  # hidden_states holds the whole stream
        return bound.args, bound.kwargs

    def _post(self, name, m, out):
        ins, full, amp = self._pending[name].pop()
        src = None if self.mode == "record" else full  # patch / jitter: (actual inputs, source call, ())
        full = None if self.mode != "record" else full
        self.order.append(name)
        conv = self.convention if name in self.blocks else "hf"
        stream = stream_of(out, conv)
        indices, probs = router_outputs(out)
        if stream is None:
            return None
        if self.mode == "jitter":  # the output's own rounding belongs to the floor too
            out = _replace_first(out, self._noise(first_tensor(out), "out"))
            stream = stream_of(out, conv)
        self.calls[name].append(Call(ins, stream.detach(), indices,
                                     None if probs is None else probs.detach(), full, amp))
        if self.hand_off and self.mode == "patch":  # the next module's hand-off sees the source's output
            return _as_output(out, self.take(src.out), conv)
        return out if self.mode == "jitter" else None

    def _replay(self, name, m, out):
        i = self._count.get(f"replay:{name}", 0)
        self._count[f"replay:{name}"] = i + 1
        rec = self.source[name]
        if i >= len(rec) or rec[i].indices is None:
            raise InvalidArgument(f"router {name!r}: no recorded expert choices to replay")
        return replay_router(m, out, self.take(rec[i].indices))


# the device types torch.autocast knows that a CPU or CUDA engine can run under
_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """((device type, dtype), ...) of every autocast context on now."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def autocast(state: tuple) -> contextlib.ExitStack:
    """Re-enter the autocast contexts `state` (autocast_state) records, and no others."""
    stack = contextlib.ExitStack()
    for d in _AUTOCAST_DEVICES:
        on = [dt for dev, dt in state if dev == d]
        if on:
            stack.enter_context(torch.autocast(d, dtype=on[0]))
        elif torch.is_autocast_enabled(d):
            stack.enter_context(torch.autocast(d, enabled=False))
    return stack


def take_rows(obj, rows, shape: tuple):
    """obj (a tensor, or tuples/lists/dicts of them) at batch rows `rows`: a tensor with B
    rows is indexed, one with B * L token rows too, one row (a broadcast table) is kept."""
    if rows is None:
        return obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(take_rows(o, rows, shape) for o in obj)
    if isinstance(obj, dict):
        return {k: take_rows(v, rows, shape) for k, v in obj.items()}
    if not isinstance(obj, torch.Tensor) or obj.ndim == 0:
        return obj
    B, L = shape
    if obj.shape[0] == B:
        return obj[rows]
    if obj.shape[0] == B * L:
        return obj.reshape(B, L, *obj.shape[1:])[rows].reshape(-1, *obj.shape[1:])
    if obj.shape[0] == 1:
        return obj
    raise InvalidArgument(f"a recorded tensor of shape {tuple(obj.shape)} has neither {B} rows "
                          f"nor {B * L} token rows: cannot run it in another batch composition")


# the keyword names HF, vLLM-style and GPT-2-style blocks take their KV cache by
_CACHE_KEYS = ("past_key_value", "past_key_values", "layer_past", "kv_cache")


def _is_cache(v) -> bool:
    return hasattr(v, "update") and hasattr(v, "get_seq_length")  # a transformers Cache


def without_cache(kwargs: dict) -> dict:
    """A recorded block call's keywords with its KV cache removed: the forward that recorded
    it may have built one (a wrapper whose forward takes **kw cannot be told use_cache=False),
    and calling the block again with it appends to the cache, so keys no longer match."""
    out = {k: (None if k in _CACHE_KEYS or _is_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def _signature(m, cache: dict) -> inspect.Signature:
    f = getattr(m.forward, "__func__", m.forward)  # one signature per forward function
    sig = cache.get(f)
    if sig is None:
        sig = cache[f] = inspect.signature(m.forward)
    return sig


def _params(m, cache: dict) -> set:
    return set(_signature(m, cache).parameters)


def _bind(m, args, kwargs, cache: dict):
    try:
        b = _signature(m, cache).bind_partial(*args, **kwargs)
    except TypeError as e:
        raise InvalidArgument(f"{type(m).__name__}.forward: cannot bind its arguments ({e})") from None
    return b


def stream_of(out, convention: str = "hf"):
    """The residual stream an output stands for (module doc of trainprobes.drift.engines)."""
    if convention == "vllm" and isinstance(out, (tuple, list)) and len(out) == 2:
        h, r = out
        return h if r is None else h + r
    t = first_tensor(out)
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def router_outputs(out) -> tuple:
    """(indices, probs) of an HF-style router output (logits [N, E], weights [N, k],
    indices [N, k] long); (None, None) for anything else."""
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        return None, None
    idx = next((t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()
                and t.ndim == 2), None)
    logits = out[0]
    if idx is None or not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        return None, None
    return idx, torch.softmax(logits.float(), dim=-1)


# relative agreement of a router's weights with a candidate rule: covers weights rounded to
# bf16 or fp16 on the way (a router in bf16 whose output is cast back to fp32: 2^-9)
WEIGHT_RTOL = 2.0 ** -6


def router_weights(m, out) -> str:
    """How the router `m` made the weights of its output `out` (logits, weights, indices):
    "renormalised" (softmax top-k over the k chosen) or "raw" (softmax top-k as is), measured
    on the rows where the two differ by more than 4 x WEIGHT_RTOL: the weights it returned
    must match one of them there, within WEIGHT_RTOL, on every such row. Anything else (a
    sigmoid or biased router, a scaled one, no row where the two differ) raises CannotJudge:
    the replay would invent the weights."""
    idx, probs = router_outputs(out)
    what = type(m).__name__
    w = next((t for t in out[1:] if isinstance(t, torch.Tensor) and t.is_floating_point()
              and idx is not None and t.shape == idx.shape), None)
    if w is None:
        raise CannotJudge(f"routing replay: {what} returns no weights shaped like its expert indices, so how "
                          "it weights the experts cannot be measured")
    if idx.shape[-1] == probs.shape[-1]:
        return "raw"  # every expert chosen: nothing to renormalise (the weights are the softmax)
    pk = probs.gather(-1, idx).double()
    cand = {"renormalised": pk / pk.sum(-1, keepdim=True), "raw": pk}
    rtol = max(WEIGHT_RTOL, 4 * torch.finfo(w.dtype).eps)
    informative = ((cand["renormalised"] - pk).abs() > 4 * rtol * cand["renormalised"].abs()).any(-1)
    if not bool(informative.any()):
        raise CannotJudge(f"routing replay: on this input {what}'s top-{idx.shape[-1]} holds nearly all the "
                          "probability mass on every token, so whether it renormalises its weights cannot be "
                          "measured (replay more varied tokens)")
    wi = w.double()[informative]
    err = {k: ((wi - v[informative]).abs() / v[informative].abs().clamp_min(1e-30)).max().item()
           for k, v in cand.items()}
    match = [k for k, e in err.items() if e <= rtol]
    if len(match) == 1:
        return match[0]
    said = ", ".join(f"{k} off by {e:.3g}" for k, e in err.items())
    raise CannotJudge(f"routing replay: {what}'s weights match neither softmax top-k renormalised nor raw "
                      f"({said} relative, tolerance {rtol:.2g}, on {int(informative.sum())} tokens where the "
                      "two differ): a router that weights experts another way (sigmoid, a bias, a scale) "
                      "cannot be replayed here")


def replay_router(m, out, indices: torch.Tensor):
    """The router's output with `indices` as its choice where its own top-k SET differs
    (its own probabilities at those experts as weights, renormalised when the router was
    measured to renormalise: router_weights); rows that agree keep the router's own output,
    so replay removes flips and nothing else."""
    old, probs = router_outputs(out)
    if old is None:
        raise InvalidArgument(f"{type(m).__name__} does not return (logits, weights, indices): "
                              "routing replay reads HF-style routers only")
    rule = router_weights(m, out)
    differ = (old.sort(-1).values != indices.sort(-1).values).any(-1, keepdim=True)
    w = probs.gather(-1, indices)
    if rule == "renormalised":
        w = w / w.sum(-1, keepdim=True)
    out = list(out)
    for i, t in enumerate(out):
        if t is old:
            out[i] = torch.where(differ, indices, old)
        elif isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == old.shape:
            out[i] = torch.where(differ, w.to(t.dtype), t)
    return tuple(out)


def _as_output(out, stream: torch.Tensor, convention: str):
    """`out` with its stream replaced by `stream` (another engine's, cast and shaped like it):
    under "vllm" a block's (hidden_states, residual) becomes (stream, 0), whose sum is exact."""
    ref = first_tensor(out)
    new = stream.reshape(ref.shape).to(ref.dtype)
    if convention == "vllm" and isinstance(out, (tuple, list)) and len(out) == 2:
        return type(out)((new, torch.zeros_like(new)))
    return _replace_first(out, new)


def _replace_first(out, new):
    if isinstance(out, torch.Tensor):
        return new
    if isinstance(out, tuple):
        return (new, *out[1:])
    return None
