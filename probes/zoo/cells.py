"""One row of the zoo map: every probe cell of one model type, each a verdict, a number and
a one-line reason, beside what the model's design says (only to call a finding; the verdict
is the probe's).

Cells (the probes are the project's own, called as a user would):
  isolation[impl,convention]  trainprobes.isolation.documents on a row of 3 documents
                              (10, 12, 8 tokens), every attention implementation that runs
                              on the CPU (eager, sdpa) x targets.CONVENTIONS, the fp64 twin
                              settling changes within rounding noise
  router[perturb|truncate]    trainprobes.causality.check of the routing decisions every MoE
                              layer hands its experts (targets.Routing), at training time
                              (perturb the future, same shape) and as inference sees it
                              (truncate), with the fp64 twin
  batch                       trainprobes.isolation.batch_invariance of the logits, rows
                              alone vs in batches of 2, 3 and 8
  drift                       trainprobes.drift.compare of fp32 (train) vs bf16 (infer)
                              log-probs of tokens sampled from the bf16 model
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, fields

import torch
from trainprobes.isolation.packing import Packing
from trainprobes.zoo.shrink import Failure, build
from trainprobes.zoo.targets import CONVENTIONS, INDEX_ARGS, Routing, ZooPacked, fp64_copy, moe_config

__all__ = ["Cell", "row", "IMPLEMENTATIONS", "PROBES", "MaskPath", "mask_path", "expected_isolation",
           "design_leak", "isolation_cell", "router_cells", "batch_cell", "drift_cell"]

IMPLEMENTATIONS = ("eager", "sdpa")
PROBES = ("isolation", "router", "batch", "drift")
LENGTHS = (10, 12, 8)
# recurrent state carried along the row: a mask cannot separate documents (that takes a
# per-document reset, seq_idx / cu_seqlens, which the HF eager paths do not take). Matched as
# whole tokens of a class name (MambaMixer -> mamba, mixer), never as substrings: "ssm" is in
# GptOss/SeedOss and "conv1d" in transformers' Conv1D (GPT-2's plain projections).
_RECURRENT_TOKENS = frozenset({
    "mamba", "mamba2", "ssm", "rwkv", "rwkv5", "rwkv6", "rwkv7", "lstm", "mlstm", "slstm", "gru",
    "rnn", "rglru", "recurrent", "deltanet", "gateddeltanet", "linearattention", "shortconv",
    "retention", "hyena", "lightningattention", "xlstm"})
# the drift cells' family-wise level: each model type's bias test runs at this / the number
# of registered types
DRIFT_ALPHA = 0.01


@dataclass
class Cell:
    model_type: str
    probe: str            # isolation, router, batch, drift, build
    variant: str          # "sdpa,mask_4d", "perturb", ""
    verdict: str          # isolated / leaky / unknown; causal / non-causal; invariant /
                          # variant; clean / noisy / biased / heavy-tailed; n/a; error
    number: float | None  # the cell's figure (see `what`)
    what: str             # what the number is
    reason: str           # one line
    expected: str | None = None   # the design's answer, where it makes one
    finding: bool = False         # the verdict contradicts `expected`
    seconds: float = 0.0
    result: object = field(default=None, repr=False, compare=False)   # the probe's Result

    def unmeasured(self, why: str, expected: str | None = None):
        """An error Result standing for this cell where its probe gave none: never dropped, never a pass."""
        from trainprobes.result import Result
        return Result(probe="zoo.cell", target=f"{self.model_type} {self.probe} {self.variant}".strip(),
                      verdict="error", message=why, expected=expected)

    def to_dict(self) -> dict:
        # the map keeps the cell; the Result serves the audit and the gate
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "result"}


def _name_tokens(name: str) -> list[str]:
    """CamelCase name -> lowercase tokens, digits kept on their word: Mamba2Mixer -> mamba2,
    mixer; Qwen3NextGatedDeltaNet -> qwen3, next, gated, delta, net."""
    return [t.lower() for t in re.findall(r"[A-Z]+[0-9]*(?![a-z])|[A-Z]?[a-z]+[0-9]*|[0-9]+", name)]


def _recurrent_class(name: str) -> bool:
    toks = _name_tokens(name)
    # adjacent tokens joined too, so GatedDeltaNet / LinearAttention / ShortConv match
    joined = {a + b for a, b in zip(toks, toks[1:])} | {a + b + c for a, b, c in zip(toks, toks[1:], toks[2:])}
    return bool(_RECURRENT_TOKENS & (set(toks) | joined))


def _state_cache(model) -> bool:
    """Whether the model's own cache carries a conv or ssm state (transformers' linear-attention
    cache layers: mamba, conv, linear_attention, hybrid layer types): state that flows from one
    position to the next, which no attention mask reaches."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin
        cache = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - an older transformers or a config the cache refuses
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in getattr(cache, "layers", []))


def _sequence_conv(m) -> bool:
    # a depthwise torch Conv1d (the causal short conv of mamba / bamba / lfm2 mixers) carries
    # kernel-1 positions across a boundary; transformers' Conv1D is a Linear and never matches
    return (isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1
            and m.groups == m.in_channels and m.in_channels > 1)


def _recurrent(model) -> bool:
    return _state_cache(model) or any(_recurrent_class(type(m).__name__) or _sequence_conv(m)
                                      for m in model.modules())


def _cell(mt, probe, variant, fn) -> Cell:
    t = time.perf_counter()
    try:
        c = fn()
    except Exception as e:  # noqa: BLE001 - a cell that cannot be measured says why
        first = (str(e).strip().splitlines() or [""])[0][:200]
        c = Cell(mt, probe, variant, "error", None, "", f"{type(e).__name__}: {first}")
    c.seconds = round(time.perf_counter() - t, 3)
    return c


@dataclass(frozen=True)
class MaskPath:
    """How one forward of the model on a packed row built its attention mask, read from the
    mechanism: transformers.masking_utils._preprocess_mask_arguments (every create_*_mask
    calls it) watched during the call. None where it could not be read."""
    masking_utils: bool | None        # the mask was built by masking_utils (a 4-D mask passes as given)
    position_ids: bool | None         # ... and it was handed the position ids (packing detection runs)
    takes_position_ids: bool          # the base model's forward names position_ids
    why: str = ""                     # what could not be read


def mask_path(model, packing: Packing | None = None) -> MaskPath:
    """One forward of a packed row (restarting position ids, use_cache=False), watching
    masking_utils._preprocess_mask_arguments: was it called, with the position ids?"""
    import inspect
    base = getattr(model, "base_model", model)
    takes = "position_ids" in inspect.signature(type(base).forward).parameters
    try:
        import transformers.masking_utils as mu
        real = mu._preprocess_mask_arguments
    except (ImportError, AttributeError) as e:
        return MaskPath(None, None, takes, f"masking_utils cannot be watched here ({type(e).__name__})")
    sig = inspect.signature(real)
    seen = []

    def watch(*args, **kwargs):
        seen.append(sig.bind(*args, **kwargs).arguments.get("position_ids") is not None)
        return real(*args, **kwargs)
    packing = packing or Packing.of(list(LENGTHS))
    tokens = torch.zeros(1, packing.length, dtype=torch.long)
    mu._preprocess_mask_arguments = watch
    try:
        with torch.no_grad():
            model(input_ids=tokens, position_ids=packing.position_ids(tokens.device), use_cache=False)
    except Exception as e:  # noqa: BLE001 - a path that cannot be read promises nothing
        return MaskPath(None, None, takes, f"the packed forward raised {type(e).__name__}")
    finally:
        mu._preprocess_mask_arguments = real
    return MaskPath(bool(seen), bool(seen) and all(seen), takes)


def _vocab(model) -> int:
    return int(min(model.get_input_embeddings().num_embeddings, 128))


def expected_isolation(model, conv: str, path: MaskPath | None = None) -> str | None:
    """What the design promises, from the mechanism: a 4-D block mask isolates documents in an
    attention-only model whose mask masking_utils builds (it passes a 4-D mask as given);
    restarting position ids alone isolate where, besides, the model takes position ids (its
    mask should then see them: find_packed_sequence_indices), and only without a cache or a
    2-D mask: _preprocess_mask_arguments reads packing "only if the 2D attention mask is
    explicitly None, and we don't have cache, i.e. generally a training setup", and a causal
    LM makes a DynamicCache unless use_cache=False, so the cached calls (position_ids,
    collator) and packed position ids beside a mask of ones (position_ids_ones_mask) carry no
    promise. Recurrent layers carry state across documents: none."""
    path = path or mask_path(model)
    if _recurrent(model) or not path.masking_utils:
        return None
    if conv == "mask_4d":
        return "isolated"
    if conv == "position_ids_no_cache" and path.takes_position_ids:
        return "isolated"
    return None


def design_leak(model, conv: str, path: MaskPath | None = None) -> str:
    """Why a leak is by design where the design promises no isolation (expected None), or
    what the mechanism shows where it breaks the promise."""
    path = path or mask_path(model)
    if _recurrent(model):
        return "by design: recurrent state (Mamba, linear attention, short conv) flows across documents"
    if path.masking_utils is None:
        return f"no promise read: {path.why}"
    if not path.masking_utils:
        return "no promise: the model builds its mask without masking_utils"
    if conv in ("position_ids", "collator"):
        return ("by design: the default use_cache makes a DynamicCache, and masking_utils."
                "_preprocess_mask_arguments reads packed position ids only without a cache")
    if conv == "position_ids_ones_mask":
        from trainprobes.isolation.hf import CONVENTION_NOTES
        return f"by design: {CONVENTION_NOTES[conv]}"
    if conv == "mask_4d":   # the position ids do not matter to a mask given in full
        return ("the 4-D block mask was given, and masking_utils passes it on as given: the leak is "
                "past the mask (a layer ignores it, or mixes tokens outside attention)")
    if not path.takes_position_ids:
        return "no promise: the model's forward takes no position_ids"
    if not path.position_ids:
        return ("the mask is built without the position ids (masking_utils._preprocess_mask_arguments "
                "got position_ids=None): packing detection never runs")
    return "the mask saw the packed position ids"


def isolation_cell(mt, model, impl, conv, seed=0, twins: dict | None = None,
                   path: MaskPath | None = None) -> Cell:
    from trainprobes.isolation.documents import documents
    V = _vocab(model)
    packing = Packing.of(list(LENGTHS))
    tokens = torch.randint(0, V, (1, packing.length), generator=torch.Generator().manual_seed(seed))
    r = documents(ZooPacked(model, conv, twins), tokens, packing, seed=seed, vocab=V, causal=False,
                  target=f"{mt}[{impl},{conv}]")
    iso = r.metrics.get("isolated")
    verdict = {True: "isolated", False: "leaky", None: "unknown"}[iso]
    path = path or mask_path(model, packing)
    expected = expected_isolation(model, conv, path)
    num = r.metrics.get("max_leak") if iso is False else r.metrics.get("max_cross_change")
    # the probe's whole message: what follows its first clause says what the verdict rests on
    # (documents whose own outputs never moved, unsettled rounding, within-row causality)
    reason = r.message
    if verdict == "isolated" and r.evidence.get("unmoved_documents"):
        # no change reached even the perturbed document: nothing could have reached another
        verdict = "unknown"
    if r.metrics.get("fp64") not in (None, "not needed"):
        reason += f" [fp64 twin {r.metrics['fp64']}]"
    if verdict == "leaky":
        reason += f"; {design_leak(model, conv, path)}"
    return Cell(mt, "isolation", f"{impl},{conv}", verdict, num, "largest change of another document's logits",
                reason, expected, expected is not None and verdict == "leaky", result=r)


def router_cells(mt, model, seed=0, modes=("perturb", "truncate"), twins: dict | None = None) -> list[Cell]:
    from trainprobes.causality import check
    routing = Routing(model)
    if not routing.has_router:
        moe = moe_config(model)
        if moe:   # a router we cannot find is not an absent one: fail closed
            return [Cell(mt, "router", "", "unknown", None, "",
                         f"cannot measure: the config says {moe} but no module's forward takes a "
                         f"routing decision ({', '.join(INDEX_ARGS)}), no router module returns one, "
                         f"and no MoE block indexes an expert table")]
        return [Cell(mt, "router", "", "n/a", None, "",
                     "no MoE layer (no expert count in the config, no module takes routing indices)")]
    if routing.untapped:
        return [Cell(mt, "router", "", "unknown", None, "", f"cannot measure every router: {routing.untapped}")]
    V = _vocab(model)
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(seed))
    kind = routing.kind(x)
    twin_model, swapped = fp64_copy(model, twins)
    twin = Routing(twin_model)
    expected = "causal" if kind.startswith("token choice") and "capacity" not in kind else "non-causal"
    out = []
    for mode in modes:
        def one(mode=mode):
            r = check(routing.decisions, x, mode=mode, seed=seed, vocab=V, fp64=twin.decisions,
                      target=f"{mt} router [{mode}]")
            c = r.metrics.get("causal")
            verdict = {True: "causal", False: "non-causal", None: "unknown"}[c]
            msg = r.message   # whole: "decisions of one sequence change with another in the batch" too
            return Cell(mt, "router", mode, verdict, float(r.metrics.get("n_leaks", 0) or 0),
                        "structural leaks (decision changes at t <= cut)",
                        f"{kind}; {len(routing.experts)} MoE layers (tap: {routing.tap}); {msg}"
                        + (f" [twin swapped {', '.join(swapped)}]" if swapped else ""),
                        expected, verdict != "unknown" and verdict != expected, result=r)
        out.append(_cell(mt, "router", mode, one))
    return out


def batch_cell(mt, model, seed=0, twins: dict | None = None) -> Cell:
    """Rows alone vs in batches; a difference is told rounding (a kernel tiled by the batch:
    grouped expert matmuls sized by tokens per expert) from data crossing rows by the fp64
    twin run through the same batches: rounding shrinks by the fp32 -> fp64 precision ratio,
    a row reading another row does not (classify_changes' scaling test, on the largest
    difference). Never by its size against the logits: a leak may be far below any scale."""
    from trainprobes.causality.classify import noise_tol
    from trainprobes.isolation.batch import batch_invariance
    V = _vocab(model)
    pool = torch.randint(0, V, (8, 16), generator=torch.Generator().manual_seed(seed))

    def probe(m, what):
        return batch_invariance(lambda x: m(input_ids=x, use_cache=False).logits, pool, sizes=(2, 3, 8),
                                trials=2, seed=seed, target=f"{mt} logits{what}")
    r = probe(model, "")
    inv = r.metrics.get("batch_invariant")
    scale = float(model(input_ids=pool[:1], use_cache=False).logits.abs().max())
    d32 = r.metrics.get("max_abs_diff", 0.0)
    verdict = {True: "invariant", False: "variant", None: "unknown"}[inv]
    finding, reason = False, r.message
    if inv is False:
        reason += f" ({d32 / max(scale, 1e-30):.2g} of the logits' scale)"
        twin, swapped = fp64_copy(model, twins)
        r64 = probe(twin, " [fp64]")
        d64 = r64.metrics.get("max_abs_diff")
        if r64.metrics.get("batch_invariant") is None or d64 is None:
            verdict = "unknown"
            reason += f"; rounding or a leak between rows cannot be told: the fp64 twin {r64.message}"
        else:
            tol64 = float(noise_tol(torch.tensor([scale], dtype=torch.float64)))
            finding = d64 > max(1e-3 * d32, tol64)
            reason += (f"; fp64 twin {d64:.3g}: " + ("data crosses rows (beyond rounding)" if finding
                                                     else "rounding (excused by the fp64 twin)")
                       + (f" [twin swapped {', '.join(swapped)}]" if swapped else ""))
    return Cell(mt, "batch", "", verdict, r.metrics.get("max_abs_diff"), "largest |logit| difference",
                reason, "invariant up to rounding", finding, result=r)


def drift_cell(mt, model, seed=0) -> Cell:
    import copy

    from trainprobes.drift.compare import compare
    V = _vocab(model)
    x = torch.randint(0, V, (16, 32), generator=torch.Generator().manual_seed(seed))
    low = copy.deepcopy(model).to(torch.bfloat16)
    lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.double(), -1)
    lq = torch.log_softmax(low(input_ids=x, use_cache=False).logits.double(), -1)
    # tokens sampled from the inference model (bf16), as an RL rollout samples them
    y = torch.multinomial(lq.exp().reshape(-1, lq.shape[-1]), 1,
                          generator=torch.Generator().manual_seed(seed + 1)).reshape(x.shape)
    train = lp.gather(-1, y[..., None])[..., 0]
    infer = lq.gather(-1, y[..., None])[..., 0]
    # one bias test per model type of the map: alpha split over them (Bonferroni), so the
    # whole map calls a model biased by chance with probability <= DRIFT_ALPHA
    from trainprobes.zoo.shrink import causal_lm_types
    alpha = DRIFT_ALPHA / len(causal_lm_types())
    r = compare(train, infer, alpha=alpha, target=f"{mt} fp32 vs bf16")
    v = r.metrics["drift_verdict"]
    return Cell(mt, "drift", "bf16 vs fp32", v, r.metrics.get("mean_log_ratio"),
                "mean log-ratio (bf16 - fp32), nats/token", f"{r.message} [alpha {alpha:.2g}: {DRIFT_ALPHA} "
                f"over the map's model types]", "not biased", v == "biased", result=r)


def row(model_type: str, *, probes=PROBES, implementations=IMPLEMENTATIONS,
        conventions=CONVENTIONS, seed: int = 0, progress=None) -> list[Cell]:
    """Every cell of model_type (a build failure is one cell saying why)."""
    torch.manual_seed(seed)
    cells: list[Cell] = []
    models = {}
    twins: dict = {}   # one fp64 copy per built model, shared by its cells
    for impl in implementations:
        t = time.perf_counter()
        b = build(model_type, attn_implementation=impl, seed=seed)
        if isinstance(b, Failure):
            cells.append(Cell(model_type, "build", impl, "n/a", None, "",
                              f"{b.stage}: {b.reason}", seconds=round(time.perf_counter() - t, 3)))
        else:
            models[impl] = b
    gaps = sorted({b.not_probed for b in models.values() if b.not_probed})
    if gaps:   # kinds of layer the modeling file names that no cell below measures
        cells.append(Cell(model_type, "build", "layer kinds", "n/a", None, "",
                          f"not probed: {'; '.join(gaps)}"))
    with torch.no_grad():
        if "isolation" in probes:
            for impl, b in models.items():
                path = mask_path(b.model)   # one watched forward per model serves its cells
                for conv in conventions:
                    if progress:
                        progress(f"{model_type} isolation {impl},{conv}")
                    cells.append(_cell(model_type, "isolation", f"{impl},{conv}",
                                       lambda: isolation_cell(model_type, b.model, impl, conv, seed, twins, path)))
        if not models:
            return cells
        main = models.get("sdpa") or next(iter(models.values()))
        if "router" in probes:
            if progress:
                progress(f"{model_type} router")
            t = time.perf_counter()
            try:
                cells += router_cells(model_type, main.model, seed, twins=twins)
            except Exception as e:  # noqa: BLE001 - the cell says why
                first = (str(e).strip().splitlines() or [""])[0][:200]
                cells.append(Cell(model_type, "router", "", "error", None, "", f"{type(e).__name__}: {first}"))
            cells[-1].seconds = cells[-1].seconds or round(time.perf_counter() - t, 3)
        if "batch" in probes:
            if progress:
                progress(f"{model_type} batch")
            cells.append(_cell(model_type, "batch", "", lambda: batch_cell(model_type, main.model, seed, twins)))
        if "drift" in probes:
            if progress:
                progress(f"{model_type} drift")
            cells.append(_cell(model_type, "drift", "bf16 vs fp32", lambda: drift_cell(model_type, main.model, seed)))
    from trainprobes.zoo.findings import annotate
    annotate(cells)   # the confirmed calls: a bug named, a by-design leak no longer a finding
    return cells
