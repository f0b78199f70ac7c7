"""Which stage (layer), then which op inside it, makes two engines disagree: activation
patching, judged against each stage's noise floor.

Runs (one forward each; "trainer" A, "engine" B, the same tokens):
  1. A recorded: every stage's and op's inputs and output stream.
  2. B free-running, recorded: free error of stage k = |B_k - A_k| / |A_k| per token.
  3. B patched: every stage k of B is fed A's input of stage k, so its output differs from
     A's only by what stage k adds itself: its OWN error. A stage that only carries an
     earlier divergence has no own error; the one that introduces it has.
  4. B patched again, in another batch composition (rows reversed, two sub-batches): the
     re-run and batch floor (zero for a deterministic, batch-invariant engine).
  5. A patched with its own inputs and outputs jittered by one rounding at the nominal
     precision u (the coarser of the two engines' dtypes): the rounding floor.
  In 3-5 each stage's output, once recorded, is replaced by A's (5: its own, jittered), and
  the inputs each stage is actually called with are recorded before they are patched: the
  row "into <stage>" is what the code between two stages (the parent's forward) adds on its
  own (trainprobes.drift.patching, hand-off).
  noise floor^2 = floor(4)^2 + floor(5)^2 per token. MoE routers are replayed with A's
  choices in 3-5, so a near-tie flip counts as routing (trainprobes.drift.routing), not as
  a block's numerics.
Verdict per stage: exact when the own error is zero on every token; else, per sequence
(the independent unit) where the stage is not exact, r = log(RMS own / RMS floor); "beyond"
(noise) when the one-sided t-test over sequences rejects E[r] <= log(margin) at alpha /
(number of stages), or every sequence's ratio exceeds a quarter of the margin (sequences
differ in how much a stage adds: the test alone missed a bf16 MLP at ratio 126 and a norm
epsilon at ratio 239, sequences at 4.7-10^4, on a tied-embedding Gemma), and the mean ratio
exceeds the margin; or when one sequence's ratio exceeds margin^2 on its own (a fault that
only some tokens or sequences meet: a rare token's path, one batch slot; noise per sequence
measured <= 1.37 over 75 noise pairs, about 3,000 sequence-stage ratios); else "noise". A
sequence where the stage is bit-exact says nothing about the noise level and is left out of
r: counted as a huge negative log ratio, exact sequences outvoted a bf16 embedding on the
sequences holding its one faulty token. The first stage beyond noise is the answer;
then the same runs over its ops (depth 1: norms, attention, MLP; depth 2 below the op
found, where a router or a norm is among its children: an MoE's router and experts,
Qwen3's q_norm) name the op. The op level calls that one block alone (record_block, then
the three runs per depth): 5 calls of one block, 8 with depth 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from scipy import stats as sps
from trainprobes.drift.engines import Engine, Layout, Stage, candidates, layout_from, match_candidates
from trainprobes.drift.patching import Call, Hooks, autocast, take_rows, without_cache
from trainprobes.drift.units import MIN_UNITS, as_units, n_units, spans_per_sequence
from trainprobes.errors import InvalidArgument

# unit roundoff of the nominal precision: what one rounding of an input does at most
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}
LOG_RATIO_CLIP = 50.0  # |log ratio| bound: a zero floor or a zero own error per sequence
# the batch-composition floor is capped at this many times the rounding floor (judge_stages)
BATCH_ROUNDINGS = 4.0


@dataclass
class StageReport:
    name: str
    role: str
    depth: int
    block: int | None
    own_error: float        # mean over tokens of |B_k(A's input) - A_k| / |A_k|
    free_error: float       # mean over tokens of |B_k - A_k| / |A_k|, free-running
    noise_floor: float      # mean over tokens of the floor (module doc)
    ratio: float            # geometric mean over sequences of RMS own / RMS floor
    p_value: float
    min_ratio: float        # the smallest per-sequence ratio
    verdict: str            # exact / noise / beyond
    nonfinite: bool = False
    max_ratio: float = 0.0  # the largest per-sequence ratio

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Runs:
    """Everything the decomposition reuses: the recorded calls of each run."""

    a: dict            # name -> [Call], A recorded
    b_free: dict
    b_patched: dict
    shape: tuple
    logits_a: torch.Tensor | None = None   # the recorded runs' logits (hooks leave them as is)
    logits_b: torch.Tensor | None = None


def _tokens(t: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """[B, L, F] in fp32 (fp64 kept): a difference of two fp32 values is exact when they are
    within a factor 2 (Sterbenz) and else rounds at 2^-24 of itself, so fp32 is enough for a
    relative error, at half the cost of fp64."""
    t = t.reshape(B, L, -1)
    return t if t.dtype == torch.float64 else t.float()


def rel_error(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """|b - a| / |a| per token ([B, L], float64); the norm over features."""
    d = (b - a).norm(dim=-1).double()
    return d / a.norm(dim=-1).double().clamp_min(1e-300)


def _outputs(calls: list, B: int, L: int) -> torch.Tensor:
    return torch.cat([_tokens(c.out, B, L) for c in calls], dim=-1)


def _forward(engine: Engine, hooks: Hooks, ids, am, rows=None):
    hooks.new_forward(rows)
    with torch.no_grad():
        return engine.logits(ids if rows is None else ids[rows],
                             None if am is None else (am if rows is None else am[rows]))


def _modules(engine: Engine, stages) -> dict:
    out = {}
    for s in stages:
        name = s if isinstance(s, str) else s.name
        try:
            out[name] = engine.module.get_submodule(name)
        except AttributeError:
            raise InvalidArgument(f"the {engine.name} has no module {name!r}, which the other engine "
                                  "has: both must carry the same module names") from None
    return out


def _routers(record: dict) -> list:
    return [n for n, calls in record.items() if calls and calls[0].indices is not None]


def record(engine: Engine, stages, ids, am, *, blocks=frozenset(), replay_from=None,
           routers=(), order=None) -> tuple:
    """One recorded forward (with A's expert choices replayed when replay_from is given);
    order: a list that receives the names in the order their forwards returned."""
    hooks = Hooks(_modules(engine, stages), "record", source=replay_from, convention=engine.convention,
                  blocks=blocks, shape=tuple(ids.shape),
                  replay=_modules(engine, [Stage(r, "router", 2, None) for r in routers])
                  if replay_from is not None else None)
    with hooks:
        logits = _forward(engine, hooks, ids, am)
    if order is not None:
        order.extend(hooks.order)
    return hooks.calls, logits


def patched(engine: Engine, stages, source: dict, ids, am, *, mode: str, blocks, routers, u=0.0,
            seed=0, compose=False, call=None) -> dict:
    """A patched (or jittered) run of `stages`; compose: rows reversed, two sub-batches,
    outputs put back in the original order. call: (module, recorded Call) to run one block
    on its own, with the arguments it was called with, instead of the whole forward."""
    B, L = ids.shape
    hooks = Hooks(_modules(engine, stages), mode, source=source, convention=engine.convention,
                  blocks=blocks, shape=(B, L), u=u, seed=seed, hand_off=call is None,
                  replay=_modules(engine, [Stage(r, "router", 2, None) for r in routers]) or None)
    parts = [None]
    if compose:
        order = torch.arange(B - 1, -1, -1)
        parts = [order[:B // 2], order[B // 2:]] if B >= 2 else [order]
    out: dict = {s.name: [] for s in stages}
    with hooks:
        for rows in parts:
            for name in hooks.calls:
                hooks.calls[name] = []
            if call is None:
                _forward(engine, hooks, ids, am, rows)
            else:
                hooks.new_forward(rows)
                args, kwargs = take_rows(call[1].full, rows, (B, L))
                kwargs = without_cache(kwargs)
                with torch.no_grad(), autocast(call[1].autocast):  # as the engine ran it
                    call[0](*args, **kwargs)
            for name, calls in hooks.calls.items():
                out[name].append((rows, calls))
    merged = {}
    for name, pieces in out.items():
        if parts == [None]:
            merged[name] = pieces[0][1]
            continue
        n_calls = len(pieces[0][1])
        merged[name] = []
        for i in range(n_calls):  # loop over calls of one module (usually one)
            merged[name].append(Call(_merge([{k: v for k, v in c[i].inputs.items() if _per_token(v, len(r), L)}
                                             for r, c in pieces], [r for r, _ in pieces], B, L),
                                     _merge([{"": c[i].out} for _, c in pieces], [r for r, _ in pieces], B, L)[""],
                                     None, None))
    return merged


def _per_token(t: torch.Tensor, rows: int, L: int) -> bool:
    return t.ndim >= 2 and t.shape[0] in (rows, rows * L)


def _merge(parts: list, rows: list, B: int, L: int) -> dict:
    """{key: [B, L, F]} from the sub-batches' {key: tensor} (each at its rows); a key missing
    from one sub-batch is dropped."""
    keys = set.intersection(*(set(p) for p in parts)) if parts else set()
    out = {}
    for k in sorted(keys):
        full = None
        for p, r in zip(parts, rows):
            t = _tokens(p[k], len(r), L)
            full = torch.empty(B, L, t.shape[-1], dtype=t.dtype) if full is None else full
            full[r] = t
        out[k] = full
    return out


HAND_OFF = "hand_off"   # the role of a hand-off row (the code before a stage: module doc)


def hand_off_name(stage: str) -> str:
    return f"into {stage}"


def _inputs(calls: list, B: int, L: int) -> torch.Tensor | None:
    """The float inputs a stage was called with, [B, L, F] (None: none per token, e.g. token ids)."""
    per = [[_tokens(v, B, L) for k, v in sorted(c.inputs.items()) if _per_token(v, B, L)] for c in calls]
    if not per or any(not p for p in per):
        return None
    return torch.cat([t for p in per for t in p], dim=-1)


def judge_stages(stages, a, b_free, b_pat, b_pat2, a_jit, mask, *, margin, alpha, u=0.0) -> list:
    """One row per stage (its own error); at the stage level (b_pat recorded with hand-offs)
    first a row "into <stage>" for the code before it (module doc of trainprobes.drift.patching)."""
    B, L = mask.shape
    m = mask.double()
    n_tok = m.sum().clamp_min(1).item()
    cases = []
    for s in stages:
        if not a.get(s.name) or not b_pat.get(s.name):
            continue
        A = _inputs(a[s.name], B, L) if s.depth == 0 else None
        Bp = _inputs(b_pat[s.name], B, L) if A is not None else None
        if Bp is not None and Bp.shape == A.shape:
            B2, J = _inputs(b_pat2[s.name], B, L), _inputs(a_jit[s.name], B, L)
            Bf = _inputs(b_free.get(s.name) or [], B, L)
            if B2 is not None and J is not None:
                cases.append((Stage(hand_off_name(s.name), HAND_OFF, 0, None), A, Bp, B2, J, Bf))
        A = _outputs(a[s.name], B, L)
        cases.append((s, A, _outputs(b_pat[s.name], B, L), _outputs(b_pat2[s.name], B, L),
                      _outputs(a_jit[s.name], B, L), _outputs(b_free[s.name], B, L) if b_free.get(s.name) else None))
    reports = []
    for s, A, Bp, B2, J, Bf in cases:
        own = rel_error(Bp, A)
        free = rel_error(Bf, A) if Bf is not None and Bf.shape == A.shape else own * math.nan
        jit = rel_error(J, A)
        batch = rel_error(B2, Bp)
        # a batch-variant kernel moves a result by roundings; more than BATCH_ROUNDINGS times the
        # rounding floor is a dependence on the other sequences (a leak): not noise
        batch = torch.minimum(batch, BATCH_ROUNDINGS * torch.maximum(jit, torch.full_like(jit, u)))
        f2 = batch ** 2 + jit ** 2
        t = stage_test(own, f2, mask, margin=margin, alpha=alpha, n_tests=len(cases))
        reports.append(StageReport(s.name, s.role, s.depth, s.block, (own * m).sum().item() / n_tok,
                                   (free * m).sum().item() / n_tok, (f2.sqrt() * m).sum().item() / n_tok, *t))
    return reports


class StageTest(NamedTuple):
    """The test of one stage, in StageReport's field order."""

    ratio: float
    p_value: float
    min_ratio: float
    verdict: str
    nonfinite: bool
    max_ratio: float


def stage_test(own: torch.Tensor, floor2: torch.Tensor, mask: torch.Tensor, *, margin: float, alpha: float,
               n_tests: int) -> StageTest:
    """The verdict of one stage (module doc) from its own error and its floor squared per token
    ([B, L] each; floor2 may be a 0-d tensor, one floor for every token). The units are the
    sequences, or spans of them when there are few (trainprobes.drift.units)."""
    k = spans_per_sequence(*mask.shape)
    floor2 = torch.as_tensor(floor2).expand_as(own)
    own, floor2, mask = as_units(own, k), as_units(floor2, k), as_units(mask, k)
    m = mask.double()
    nonfinite = not bool(torch.isfinite(own[mask]).all())
    own_u = ((own ** 2 * m).sum(1) / m.sum(1).clamp_min(1)).sqrt()
    floor_u = ((floor2 * m).sum(1) / m.sum(1).clamp_min(1)).sqrt()
    # a sequence where the stage is exact carries no evidence about the noise level (module doc)
    used = (m.sum(1) > 0) & (own_u != 0)
    r = (own_u.log() - floor_u.log()).nan_to_num(nan=LOG_RATIO_CLIP, posinf=LOG_RATIO_CLIP, neginf=-LOG_RATIO_CLIP)
    r = r.clamp(-LOG_RATIO_CLIP, LOG_RATIO_CLIP)[used]
    exact = bool((own[mask] == 0).all())
    ratio = math.exp(r.mean().item()) if r.numel() else 0.0
    p = 1.0 if exact else p_greater(r, math.log(margin))
    low = math.exp(r.min().item()) if r.numel() else 0.0
    high = math.exp(r.max().item()) if r.numel() else 0.0
    # beyond: the mean ratio past the margin, and the t-test over sequences or every
    # sequence past a quarter of the margin (noise: 0.4-1.37 per sequence, measured); or one
    # sequence past margin^2 on its own
    beyond = nonfinite or (not exact and (ratio > margin and (p < alpha / max(1, n_tests) or low > margin / 4)
                                          or high > margin ** 2))
    return StageTest(0.0 if exact else ratio, p, 0.0 if exact else low,
                     "exact" if exact else "beyond" if beyond else "noise", nonfinite, 0.0 if exact else high)


def p_greater(r: torch.Tensor, mu: float) -> float:
    x = r.double().numpy()
    if len(x) < 2:
        return math.nan
    if x.std() == 0:
        return 0.0 if x.mean() > mu else 1.0
    return float(sps.ttest_1samp(x, mu, alternative="greater").pvalue)


@dataclass
class Localisation:
    stages: list           # [StageReport] depth 0
    ops: list              # [StageReport] depth 1 and 2 of the first stage beyond noise
    first_layer: str | None
    op: str | None         # role of the op found
    op_module: str | None
    layout: Layout
    runs: Runs
    u: float
    n_forwards: int
    context: object = None  # the _Context of its runs: ops_of another block later


def localize_layers(trainer: Engine, engine: Engine, input_ids, attention_mask=None, *,
                    margin: float = 8.0, alpha: float = 0.01, seed: int = 0, ops: bool = True,
                    u: float | None = None, progress=None) -> Localisation:
    """The runs of the module doc and the verdict per stage, then per op of the first stage
    beyond noise. input_ids [B, L], B >= 1 sequences (the units of the tests: sequences, or
    spans of them when B < 4, trainprobes.drift.units), no sequence repeated.
    progress(forwards done, what runs next): called before each run, for a long model."""
    tell = progress or (lambda done, what: None)
    ids = torch.as_tensor(input_ids)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise InvalidArgument(f"input_ids has shape {tuple(ids.shape)}, expected [B, L] with B >= 1 sequences "
                              "and L >= 2 tokens")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise InvalidArgument(f"input_ids has dtype {ids.dtype}, expected integer token ids")
    # the scored positions (L - 1) must give at least two units: an interval from one is none
    if n_units(ids.shape[0], ids.shape[1] - 1) < MIN_UNITS:
        raise InvalidArgument(f"input_ids has shape {tuple(ids.shape)}: {ids.shape[1] - 1} scored position(s) of "
                              f"one sequence cannot be cut into {MIN_UNITS} spans of 2 tokens, and no test or "
                              "interval can be estimated from one unit: give a sequence of L >= 5 tokens, or more "
                              "sequences")
    vocab = [vocab_size(e.module) for e in (trainer, engine)]
    if None not in vocab and vocab[0] != vocab[1]:
        raise InvalidArgument(f"the {trainer.name}'s vocabulary has {vocab[0]} ids and the {engine.name}'s "
                              f"{vocab[1]}: a tokenizer mismatch; both must score the same token ids")
    known = min((v for v in vocab if v is not None), default=None)
    if ids.numel() and (int(ids.min()) < 0 or known is not None and int(ids.max()) >= known):
        raise InvalidArgument(f"input_ids hold ids in [{int(ids.min())}, {int(ids.max())}], outside the "
                              f"vocabulary [0, {known}) (tokens from another tokenizer?)")
    am = None if attention_mask is None else torch.as_tensor(attention_mask)
    if am is not None and am.shape != ids.shape:
        raise InvalidArgument(f"attention_mask has shape {tuple(am.shape)}, expected {tuple(ids.shape)}")
    _check_distinct(ids, am)
    mask = torch.ones(ids.shape, dtype=torch.bool) if am is None else am.bool()
    ca, cb = candidates(trainer.module), candidates(engine.module)
    match_candidates(ca, cb, (trainer.name, engine.name))
    if u is None:
        u = max(unit_roundoff(trainer), unit_roundoff(engine))
    elif not 0 < u < 1:
        raise InvalidArgument(f"u={u!r} is not a unit roundoff: expected 0 < u < 1 (fp32 2**-24, bf16 2**-8)")
    # the free runs record the stages and the routers only (replay needs every router's
    # choices); a block's ops are recorded later by calling that one block alone
    # (record_block): recording every op of every block kept each op's output alive, and the
    # fresh memory cost a third of a forward per run
    names = ca.stages + [o.name for ops_ in ca.ops.values() for o in ops_ if o.role == "router"]
    blocks = frozenset(f"{ca.list_name}.{i}" for i in range(ca.n_blocks))
    order: list = []
    tell(0, f"the {trainer.name}'s forward, recorded")
    a, z = record(trainer, names, ids, am, blocks=blocks, order=order)
    B_, L_ = ids.shape
    la = layout_from(ca, order, {n: (tuple(c[0].out.shape) if c else None) for n, c in a.items()},
                     B_, L_, z.shape[-1])
    stages = la.stages
    _check_finite(a, trainer, order, ca)
    routers = _routers(a)
    tell(1, f"the {engine.name}'s forward, recorded")
    b_free, z_b = record(engine, names, ids, am, blocks=blocks, order=(order_b := []))
    if tuple(z_b.shape) != tuple(z.shape):
        raise InvalidArgument(f"the {trainer.name}'s logits have shape {tuple(z.shape)} and the {engine.name}'s "
                              f"{tuple(z_b.shape)} (a vocabulary of {z.shape[-1]} against {z_b.shape[-1]}: a "
                              "tokenizer mismatch?); both must score the same token ids")
    _check_finite(b_free, engine, order_b, ca)
    n = 2

    tell(2, f"the {engine.name} patched at every stage, and the {trainer.name} jittered")
    ctx = _Context(trainer, engine, a, b_free, ids, am, mask, blocks, routers, u, seed, margin, alpha)
    b_pat, reports = ctx.depth_runs(stages)
    n += 4  # the composed run is two half-batch forwards
    first = next((r for r in reports if r.verdict == "beyond"), None)
    op_reports, op_role, op_module = [], None, None
    if first is not None and first.role == "block" and ops:
        tell(n, f"the ops of {first.name}")
        op_reports, op_role, op_module, more = ctx.ops_of(first, la)
        n += more
    elif first is not None and first.role == HAND_OFF:  # the code between two stages, before this one
        op_role, op_module = HAND_OFF, first.name[len(hand_off_name("")):]
    elif first is not None:
        op_role, op_module = first.role, first.name
    n = round(n, 3)
    return Localisation(reports, op_reports, None if first is None else first.name, op_role, op_module,
                        la, Runs(a, b_free, b_pat, tuple(ids.shape), z, z_b), u, n, ctx)


@dataclass
class _Context:
    """What the patched runs of one localisation share (localize_layers, then ops_of)."""

    trainer: Engine
    engine: Engine
    a: dict
    b_free: dict
    ids: torch.Tensor
    am: torch.Tensor | None
    mask: torch.Tensor
    blocks: frozenset
    routers: list
    u: float
    seed: int
    margin: float
    alpha: float

    def depth_runs(self, group, block=None):
        """The three patched runs of `group` and their verdicts; block: call that one block
        alone, as each engine called it, instead of the whole forward."""
        kw = dict(blocks=self.blocks, routers=self.routers)
        cb_ = ca_ = None
        if block is not None:
            cb_ = (self.engine.module.get_submodule(block), self.b_free[block][0])
            ca_ = (self.trainer.module.get_submodule(block), self.a[block][0])
        ids, am, a = self.ids, self.am, self.a
        p1 = patched(self.engine, group, a, ids, am, mode="patch", call=cb_, **kw)
        p2 = patched(self.engine, group, a, ids, am, mode="patch", compose=True, call=cb_, **kw)
        j = patched(self.trainer, group, a, ids, am, mode="jitter", u=self.u, seed=self.seed, call=ca_, **kw)
        return p1, judge_stages(group, a, self.b_free, p1, p2, j, self.mask, margin=self.margin, alpha=self.alpha,
                                u=self.u)

    def ops_of(self, stage: StageReport, la: Layout) -> tuple:
        """(op reports, op role, op module, forwards spent) inside the block `stage`: depth 1,
        then depth 2 where a router or a norm is among the op's children (module doc)."""
        a, b_free = self.a, self.b_free
        block_ops = [o for o in la.ops[stage.block] if o.name not in a]
        a.update(record_block(self.trainer, block_ops, a[stage.name][0])[0])
        b_free.update(record_block(self.engine, block_ops, b_free[stage.name][0])[0])
        n = 2 / la.n_blocks
        d1 = [o for o in la.ops[stage.block] if o.depth == 1 and o.name in a and a[o.name]]
        _, op_reports = self.depth_runs(d1, stage.name)
        n += 4 / la.n_blocks  # one block, not the model
        top = _top(op_reports)
        if top is None:
            return op_reports, "block", stage.name, n  # the residual adds or unhooked code
        op_role, op_module = top.role, top.name
        d2 = [o for o in la.ops[stage.block] if o.depth == 2 and o.name.startswith(top.name + ".") and a.get(o.name)]
        # one level further only where it can rename the op: a router or a norm inside it
        # (an MoE's gate, Qwen3's q_norm); a dense MLP's projections would cost three more
        # calls of the block and name the same op
        if any(o.role in ("router", "norm") for o in d2):
            _, deeper = self.depth_runs(d2, stage.name)
            n += 4 / la.n_blocks
            op_reports += deeper
            hits = [r for r in deeper if r.verdict == "beyond"]
            # a router or norm names the op only when it alone is beyond noise: an MoE
            # block wholly in bf16 has its router and its experts beyond, and is the MLP
            if len(hits) == 1 and hits[0].role in ("router", "norm"):
                op_role, op_module = hits[0].role, hits[0].name
        return op_reports, op_role, op_module, n


def _check_distinct(ids: torch.Tensor, am) -> None:
    """Repeated sequences are not independent units: their tests and intervals would be
    degenerate (zero width from identical copies)."""
    rows = ids if am is None else torch.cat([ids, am.to(ids.dtype)], dim=1)
    uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if uniq.shape[0] < rows.shape[0]:
        first = torch.full((uniq.shape[0],), -1, dtype=torch.long)
        for i, u in enumerate(inverse.tolist()):  # loop over rows, to name the first repeat
            if first[u] >= 0:
                raise InvalidArgument(f"input_ids rows {int(first[u])} and {i} are the same sequence: a repeated "
                                      "sequence is not an independent unit, and its copies would make the intervals "
                                      "zero-width; give each sequence once (one sequence is enough: it is cut into "
                                      "spans of tokens)")
            first[u] = i


def unit_roundoff(engine: Engine) -> float:
    """The unit roundoff of the engine's nominal dtype; an unknown one (fp8, an integer
    quantised engine) is refused, not guessed: the floor would be wrong by orders."""
    dt = engine.dtype
    if dt not in UNIT_ROUNDOFF:
        raise InvalidArgument(f"the {engine.name}'s nominal dtype is {dt} (the dtype of most of its floating "
                              f"parameters), whose rounding floor is not known here (known: "
                              f"{', '.join(str(d).removeprefix('torch.') for d in UNIT_ROUNDOFF)}): pass u=, the "
                              "unit roundoff of its arithmetic (--unit-roundoff)")
    return UNIT_ROUNDOFF[dt]


def vocab_size(module: torch.nn.Module) -> int | None:
    """The ids a model embeds: its config's vocab_size, else its input embedding's rows (a
    plain module: its first nn.Embedding)."""
    v = getattr(getattr(module, "config", None), "vocab_size", None)
    if isinstance(v, int):
        return v
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)
    return getattr(emb, "num_embeddings", None)


def _top(reports):
    beyond = [r for r in reports if r.verdict == "beyond"]
    return max(beyond, key=lambda r: r.ratio) if beyond else None


def record_block(engine: Engine, ops, call: Call) -> tuple:
    """(name -> [Call], names in return order) of `ops` (Stages inside one block), recorded by
    calling the block alone with the arguments and autocast state it was called with (`call`,
    recorded by `record`): the same computation as inside the forward."""
    mod = engine.module.get_submodule(call_block_name(ops))
    hooks = Hooks(_modules(engine, ops), "record", convention=engine.convention)
    args, kwargs = call.full
    with hooks:
        hooks.new_forward()
        with torch.no_grad(), autocast(call.autocast):
            mod(*args, **without_cache(kwargs))
    return hooks.calls, hooks.order


def call_block_name(ops) -> str:
    """The block the ops (Stages of one block) belong to: their common module path."""
    names = [o.name for o in ops if o.depth == 1]
    if not names:
        raise InvalidArgument("no ops to record: a block with no child modules")
    return names[0].rpartition(".")[0]


def _check_finite(rec: dict, engine: Engine, order: list, ca) -> None:
    """Name the first stage (in call order) whose output is not finite, and the op inside it
    that made it so (a block is called alone with its ops recorded to find it)."""
    look = [n for n in dict.fromkeys(order) if n in set(ca.stages)]
    for name in look:
        for c in rec.get(name, []):
            if not bool(torch.isfinite(c.out).all()):
                inner = None
                if c.full is not None and name.startswith(ca.list_name + "."):
                    ops = ca.ops[int(name.rpartition(".")[2])]
                    calls, order_ops = record_block(engine, ops, c)
                    inner = next((n for n in dict.fromkeys(order_ops)
                                  if any(not bool(torch.isfinite(k.out).all()) for k in calls.get(n, []))), None)
                raise InvalidArgument(f"the {engine.name}'s {name!r} output holds non-finite values"
                                      + (f" (first from {inner!r})" if inner else "")
                                      + ": localisation compares finite activations (fix the "
                                      "overflow first, e.g. with trainprobes numerics)")
