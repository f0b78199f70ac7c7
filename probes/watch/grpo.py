"""The drift monitor inside TRL's GRPOTrainer, through TRL's own extension points.

    monitor = GRPODriftMonitor(report="drift.json")
    trainer = GRPOTrainer(..., rollout_func=monitor.wrap(my_rollout), callbacks=[monitor])

Why the rollout_func: no TrainerCallback is handed per-token log-probs (on_log gets the
averaged logs dict, on_step_end the model), and with a rollout_func TRL 1.16 computes no
trainer-side log-probs of the sampled tokens at all (old_per_token_logps only on its vLLM
path). The wrapper calls the user's rollout_func, returns its output untouched, and scores
the same completion tokens with the trainer's model the way GRPOTrainer scores them
(`model(..., labels=, fused_lm_head=True)`, the head trl.add_fused_lm_head added, with the
run's temperature, under `trainer.accelerator.autocast()`, torch.no_grad, the global RNG
state forked so no dropout draw moves the run's generator). The sampler's log-probs
(`logprobs`) and the trainer's feed a DriftMonitor per look interval and one for the run.

Every `interval` generation batches is a look k: the interval's tokens and the run's so far
are judged at alpha_k / 2 each, alpha_k = alpha 6 / (pi^2 k^2) (trainprobes.watch.stream),
so the chance of any false "biased" over a run of any length stays under alpha. A look's
numbers go to the trainer's logger (added to the logs of its next on_log) and to `report`
(report_document's shape, command "watch.grpo"; one Result per target, the gate's key),
rewritten at each finding and at the end.

Sampling parameters: TRL scores with temperature only; top-p, top-k, min-p and a repetition
penalty change what the sampler draws from. Raw log-probs that agree while the sampling was
truncated are still off-policy: the Result says so (verdict at least "warn").
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from trainprobes.drift.monitor import DriftMonitor
from trainprobes.errors import InvalidArgument, InvalidType, OutputExists
from trainprobes.result import Result, save_results
from trainprobes.validation import check_bool, check_int, check_number
from trainprobes.watch.rng import keep_rng
from trainprobes.watch.sentinel import SentinelFinding
from trainprobes.watch.stream import look_alpha
from transformers import TrainerCallback

log = logging.getLogger("trainprobes.watch")
PROBE = "drift.compare"  # the gate reads a look's Result as any drift comparison
KEYS = ("prompt_ids", "completion_ids", "logprobs")  # TRL 1.16's rollout_func contract
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_of(args, declared: dict | None = None) -> dict:
    """The sampling parameters in force: GRPOConfig's, overridden by what the user declares
    their sampler uses (a rollout_func may ignore the config)."""
    out = {k: getattr(args, k, None) for k in SAMPLING}
    out.update(declared or {})
    return out


def truncation_of(sampling: dict) -> list[str]:
    """The parameters that make the sampler draw from another distribution than the one the
    trainer scores (softmax(logits / T) over the whole vocabulary)."""
    out = []
    if sampling.get("top_p") is not None and sampling["top_p"] < 1.0:
        out.append(f"top_p={sampling['top_p']:g}")
    if sampling.get("top_k") not in (None, 0, -1):
        out.append(f"top_k={sampling['top_k']}")
    if sampling.get("min_p") not in (None, 0, 0.0):
        out.append(f"min_p={sampling['min_p']:g}")
    if sampling.get("repetition_penalty") not in (None, 1, 1.0):
        out.append(f"repetition_penalty={sampling['repetition_penalty']:g}")
    return out


def _sampler_rows(output: dict) -> tuple[list, list, list, list | None]:
    """Check the rollout's output and return (prompt_ids, completion_ids, logprobs, env_mask)
    as lists of lists, naming the first bad field and what works."""
    if not isinstance(output, dict):
        raise InvalidType(f"rollout_func returned a {type(output).__name__}; TRL's contract is a dict with "
                          f"keys {list(KEYS)}")
    missing = [k for k in KEYS if output.get(k) is None]
    if missing:
        raise InvalidArgument(f"rollout_func returned no {missing}: the monitor compares the sampler's "
                              "log-prob of each sampled token ('logprobs', one float per completion token) "
                              "with the trainer's")
    prompts, completions, lps = (list(output[k]) for k in KEYS)
    env = output.get("env_mask")
    if not (len(prompts) == len(completions) == len(lps)):
        raise InvalidArgument(f"rollout_func returned {len(prompts)} prompt_ids, {len(completions)} "
                              f"completion_ids and {len(lps)} logprobs; expected one of each per completion")
    if env is not None and len(env) != len(completions):
        raise InvalidArgument(f"rollout_func's env_mask has {len(env)} rows, expected {len(completions)} "
                              "(one per completion)")
    for i, (c, lp) in enumerate(zip(completions, lps)):
        if len(lp) != len(c):
            raise InvalidArgument(f"rollout_func's logprobs[{i}] has {len(lp)} entries, completion_ids[{i}] "
                                  f"{len(c)}: expected the log-prob of each sampled token")
        if env is not None and len(env[i]) != len(c):
            raise InvalidArgument(f"rollout_func's env_mask[{i}] has {len(env[i])} entries, "
                                  f"completion_ids[{i}] {len(c)}: a mask needs one entry per token")
        if lp and not (lp[0] is None or isinstance(lp[0], (int, float))
                       or isinstance(lp[0], torch.Tensor) and lp[0].ndim == 0):
            kind = type(lp[0]).__name__
            raise InvalidType(f"rollout_func's logprobs[{i}][0] is a {kind} ({lp[0]!r:.60}), not a number: "
                              "expected the sampled token's log-prob, one float per token, not top-k "
                              "lists (with vLLM: SamplingParams(logprobs=0), and take the entry of the "
                              "sampled token id)")
    return prompts, completions, lps, env


def _pad(rows, value, side: str, dtype) -> torch.Tensor:
    n = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), n), value, dtype=dtype)
    for i, r in enumerate(rows):  # a loop over sequences, not elements
        if len(r):
            t = torch.as_tensor(r, dtype=dtype)
            if side == "left":
                out[i, n - len(r):] = t
            else:
                out[i, :len(r)] = t
    return out


@torch.no_grad()
def trainer_logprobs(trainer, prompt_ids: list, completion_ids: list, batch_size: int) -> torch.Tensor:
    """The trainer's log-probs [B, C] of the completion tokens (right-padded), computed as
    GRPOTrainer computes them: prompts left-padded, completions right-padded, one forward of
    prompt + completion through the fused head TRL added (temperature included) under the
    accelerator's autocast. A model without that head is scored through its logits / T."""
    model = trainer.model
    device = next(model.parameters()).device
    prompt = _pad(prompt_ids, 0, "left", torch.long)
    pmask = _pad([[1] * len(p) for p in prompt_ids], 0, "left", torch.long)
    comp = _pad(completion_ids, 0, "right", torch.long)
    cmask = _pad([[1] * len(c) for c in completion_ids], 0, "right", torch.long)
    ids, am = torch.cat([prompt, comp], 1).to(device), torch.cat([pmask, cmask], 1).to(device)
    keep = comp.shape[1]
    temperature = float(getattr(trainer.args, "temperature", 1.0) or 1.0)
    out = []
    with keep_rng():  # the run's generators stay where they were
        for s in range(0, ids.shape[0], batch_size):  # a loop over chunks, as TRL's
            i, m = ids[s:s + batch_size], am[s:s + batch_size]
            labels = i.masked_fill(m == 0, -100)
            labels[:, :-keep] = -100
            with trainer.accelerator.autocast():
                try:
                    o = model(input_ids=i, attention_mask=m, labels=labels, fused_lm_head=True)
                except TypeError:  # a forward without **kwargs
                    o = model(input_ids=i, attention_mask=m)
                lp = getattr(o, "log_probs", None)
                if lp is not None:
                    lp = lp[:, -keep:]
                else:  # no fused head on this model: its logits, with TRL's temperature
                    logits = o.logits[:, -keep - 1:-1]
                    lp = torch.log_softmax(logits.float() / temperature, -1).gather(
                        -1, i[:, -keep:].unsqueeze(-1)).squeeze(-1)
            out.append(lp.float().cpu())
    return torch.cat(out, 0)


class GRPODriftMonitor(TrainerCallback):
    """Sampler vs trainer log-prob drift in a TRL GRPOTrainer run; see the module docstring.

    Defaults: one generation batch in 64 scored, a look every 4 scored batches (every 256
    generation batches): 0.41% of a tiny-model GRPO step (benchmarks/bench_drift_trl.py).
    every=1 scores each batch and catches sooner, at one scoring forward per step.
    interval: scored generation batches between looks. alpha: the chance of any false
        "biased" over the run. every: score one generation batch in `every` (the 1st, the
        (1 + every)th, ...; no random draw) and max_sequences: at most this many completions
        of a scored batch (the first ones; None: all). Both bound the monitor's cost per step
        (one forward of the scored tokens, no backward; see docs/drift_trl.md for figures).
    report: a JSON report path (refused if it exists, unless overwrite=True).
    sampling: the parameters the sampler really uses, where they differ from GRPOConfig's
        ({"temperature": 0.7, "top_p": 0.9, ...}).
    localize: opt-in, a callable(trainer) returning the sampler's in-process module, or a
        trainprobes.drift.engines.Engine (module + the log-prob function it reports with:
        temperature, top-p renormalisation, logprobs mode). On the first biased looks (at most
        `localize_max`) `drift localize` runs on the last scored batch's tokens, at most
        `localize_sequences` completions cut to `localize_length` tokens, and its Result
        (the stage, op or post-processing step that explains the drift, and its share) joins
        the results, the report and the logs (trainprobes.watch.grpo_localize).
        localize_at: also run it once at the first look at or after this trainer step,
        whatever the verdict (a noisy pair's stage; counted in localize_max).
    stop_on_finding: a biased look, or an error of the monitor's own, ends the run
        (SentinelFinding, exit 1). Otherwise errors of its own are logged and counted, and
        the run goes on.
    The other options are DriftMonitor's (the verdict rules of drift.compare).
    """

    def __init__(self, *, interval: int = 4, alpha: float = 0.01, every: int = 64,
                 max_sequences: int | None = None,
                 report: str | Path | None = None, overwrite: bool = False, sampling: dict | None = None,
                 stop_on_finding: bool = False, localize=None, localize_max: int = 1,
                 localize_sequences: int = 8, localize_length: int = 64, localize_at: int | None = None,
                 **monitor_options):
        self.interval = check_int(interval, "interval", min=1, hint="scored generation batches between looks")
        self.every = check_int(every, "every", min=1, hint="score one generation batch in `every`")
        self.alpha = check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
        if max_sequences is not None:
            check_int(max_sequences, "max_sequences", min=1, hint="completions scored per step, or None")
        self.max_sequences = max_sequences
        self.stop_on_finding = check_bool(stop_on_finding, "stop_on_finding")
        if sampling is not None and not isinstance(sampling, dict):
            raise InvalidType(f"sampling={sampling!r} must be a dict such as {{'top_p': 0.9}}")
        unknown = [k for k in (sampling or {}) if k not in SAMPLING]
        if unknown:
            raise InvalidArgument(f"sampling names {unknown}; known: {list(SAMPLING)}")
        self.declared = dict(sampling or {})
        if localize is not None and not callable(localize):
            raise InvalidType(f"localize={localize!r} is not callable; pass a function of the trainer returning "
                              "the sampler's nn.Module or a trainprobes Engine (e.g. localize=lambda t: engine)")
        self.localize = localize
        self.localize_max = check_int(localize_max, "localize_max", min=1, hint="localize runs per run")
        self.localize_sequences = check_int(localize_sequences, "localize_sequences", min=1,
                                            hint="completions localize scores")
        self.localize_length = check_int(localize_length, "localize_length", min=2,
                                         hint="tokens per sequence (prompt + completion) localize runs")
        if localize_at is not None:
            check_int(localize_at, "localize_at", min=0, hint="a trainer step, or None")
            if localize is None:
                raise InvalidArgument("localize_at needs localize= (the sampler's module or Engine)")
        self.localize_at = localize_at
        self.localized = 0
        self._last: tuple | None = None  # (prompt_ids, completion_ids) of the last scored batch
        self.report = Path(report) if report is not None else None
        if self.report is not None and self.report.exists() and not check_bool(overwrite, "overwrite"):
            raise OutputExists(f"report={str(self.report)!r} exists (another run's?): pass another path or "
                               "overwrite=True")
        self.monitor_options = {"on_alarm": "record", "history": 1000, **monitor_options}
        self.run = DriftMonitor(target="watch:grpo[run]", **self.monitor_options)  # options checked here
        self.window = DriftMonitor(target="watch:grpo[interval]", **self.monitor_options)
        self.batches = 0  # generation batches scored
        self.seen = 0  # generation batches seen
        self.looks = 0
        self.results: list[Result] = []
        self.rows: list[dict] = []  # one per look: what went to the logger
        self.pending: dict = {}  # numbers of the last look, added at the next on_log
        self.errors: list[str] = []
        self.error_count = 0
        self.own_seconds = 0.0
        self.found_at: dict = {}  # "interval"/"run" -> generation batches seen at the first biased call
        self.clip = {"run": [0, 0], "interval": [0, 0]}  # [tokens TRL's IS would change, tokens]
        self.trainer = None
        self.sampling: dict = dict(self.declared)
        self._closed = False

    # --- the rollout_func wrapper --------------------------------------------------------

    def wrap(self, rollout_func):
        """The user's rollout_func, observed: same arguments, same output object."""
        if not callable(rollout_func):
            raise InvalidType(f"rollout_func={rollout_func!r} is not callable; pass the function GRPOTrainer "
                              "would call as rollout_func(prompts, trainer)")

        def rollout(prompts, trainer):
            output = rollout_func(prompts, trainer)
            self.observe(output, trainer)
            return output

        rollout.__wrapped__ = rollout_func
        return rollout

    def observe(self, output, trainer) -> None:
        """Score one generation batch and feed the monitors; a look every `interval`."""
        self.seen += 1
        if (self.seen - 1) % self.every:
            return
        t0 = time.perf_counter()
        try:
            self._attach(trainer)
            prompts, completions, lps, env = _sampler_rows(output)
            if self.max_sequences is not None:
                prompts, completions, lps = (x[:self.max_sequences] for x in (prompts, completions, lps))
                env = env[:self.max_sequences] if env is not None else None
            bs = int(getattr(trainer.args, "per_device_train_batch_size", 8) or 8)
            train = trainer_logprobs(trainer, prompts, completions, bs)
            # vLLM gives None for a NaN log-prob (TRL maps it to NaN): refused below, by position
            infer = _pad([[math.nan if v is None else float(v) for v in r] for r in lps], 0.0, "right",
                         torch.float32)
            mask = _pad([[1] * len(c) for c in completions], 0, "right", torch.long).bool()
            if env is not None:
                mask &= _pad(env, 0, "right", torch.long).bool()
            try:
                self.run.update(train, infer, mask)
            except InvalidArgument as e:  # name the field in the user's terms
                raise InvalidArgument(str(e).replace("infer_logprobs", "rollout_func's logprobs (the sampler)")
                                      .replace("train_logprobs", "the trainer's log-probs")) from None
            self.window.update(train, infer, mask)
            if self.localize is not None:
                self._last = (prompts, completions)
            self._count_clipped(train, infer, mask)
            self.batches += 1
        except Exception as e:
            self._own_error("scoring a generation batch", e)
            return
        finally:
            self.own_seconds += time.perf_counter() - t0
        if self.batches % self.interval == 0:
            self._look()

    def _attach(self, trainer) -> None:
        if self.trainer is trainer:
            return
        missing = [a for a in ("model", "args", "accelerator", "state") if not hasattr(trainer, a)]
        if missing:
            raise InvalidArgument(f"trainer={type(trainer).__name__} has no {missing}: the monitor attaches to "
                                  "a TRL GRPOTrainer (rollout_func=monitor.wrap(f) is called by it with "
                                  "(prompts, trainer))")
        self.trainer = trainer
        self.sampling = sampling_of(trainer.args, self.declared)

    def _count_clipped(self, train, infer, mask) -> None:
        """Tokens whose weight TRL's truncated importance sampling changes (its mode and caps,
        read from GRPOConfig): ratio = exp(trainer - sampler) per token, or per sequence for
        the sequence_* modes, outside [clip_min, clip_max]."""
        args = self.trainer.args
        mode = getattr(args, "vllm_importance_sampling_mode", "sequence_mask")
        hi = getattr(args, "vllm_importance_sampling_clip_max", None)
        lo = getattr(args, "vllm_importance_sampling_clip_min", None)
        d = torch.where(mask, train.double() - infer.double(), 0.0)
        if str(mode).startswith("sequence"):
            d = d.sum(1, keepdim=True).expand_as(d)
        out = torch.zeros_like(mask)
        if hi is not None:
            out |= d > math.log(hi)
        if lo is not None:
            out |= d < (math.log(lo) if lo > 0 else -math.inf)
        changed, n = int((out & mask).sum()), int(mask.sum())
        for k in self.clip:
            self.clip[k][0] += changed
            self.clip[k][1] += n

    # --- looks -----------------------------------------------------------------------------

    def _look(self) -> None:
        t0 = time.perf_counter()
        try:
            self.looks += 1
            a = look_alpha(self.alpha, self.looks, 2)  # two tests per look: the interval and the run
            step = int(getattr(self.trainer.state, "global_step", 0))
            new = []
            row = {}
            for name, mon in (("interval", self.window), ("run", self.run)):
                r = self._result(mon, name, a, step)
                m = r.metrics
                row.update({f"drift/{name}/verdict": m["drift_verdict"], f"drift/{name}/biased": int(m["biased"]),
                            f"drift/{name}/mean_log_ratio": m["mean_log_ratio"],
                            f"drift/{name}/ci_low": m["ci_low"], f"drift/{name}/ci_high": m["ci_high"],
                            f"drift/{name}/k3_kl": m["k3_kl"], f"drift/{name}/p_value": m["p_value"],
                            f"drift/{name}/ratio_p99.9": m.get("ratio_p99.9", math.nan),
                            f"drift/{name}/ratio_p0.1": m.get("ratio_p0.1", math.nan),
                            f"drift/{name}/trl_is_changed_share": m["trl_is_changed_share"]})
                if m["biased"] and name not in self.found_at:
                    self.found_at[name] = r.evidence["found_at_batch"] = self.batches
                    new.append(r)
            row.update({"drift/look": self.looks, "drift/generation_batches": self.batches, "drift/alpha_look": a, "drift/own_errors": self.error_count,
                        "drift/own_seconds": self.own_seconds})
            self.rows.append({"step": step, **row})
            self.pending = row
            self.window = DriftMonitor(target="watch:grpo[interval]", **self.monitor_options)
            self.clip["interval"] = [0, 0]
        except Exception as e:
            self._own_error("judging a look", e)
            return
        finally:
            self.own_seconds += time.perf_counter() - t0
        for r in new:
            log.warning("trainprobes drift (step %d): %s", r.evidence["step"], r.message)
            self.results.append(r)
        due = self.localize_at is not None and step >= self.localize_at
        if (new or due) and self.localize is not None and self.localized < self.localize_max:
            if due:
                self.localize_at = None  # once
            self._localize(step)
        if new:
            self._write()
            if self.stop_on_finding:
                raise SentinelFinding(self.close())

    def _localize(self, step: int) -> None:
        """drift localize on the last scored batch (trainprobes.watch.grpo_localize); its
        errors are the monitor's own."""
        from trainprobes.watch.grpo_localize import localize_batch, sampler_engine
        self.localized += 1
        t0 = time.perf_counter()
        try:
            if self._last is None:
                raise InvalidArgument("no scored batch to localize on")
            t = self.sampling.get("temperature") or getattr(self.trainer.args, "temperature", 1.0) or 1.0
            engine = sampler_engine(self.localize(self.trainer), float(t))
            r = localize_batch(self.trainer, engine, *self._last, sequences=self.localize_sequences,
                               length=self.localize_length, alpha=self.alpha, step=step)
        except Exception as e:
            self._own_error("localizing", e)
            return
        finally:
            self.own_seconds += time.perf_counter() - t0
        m = r.metrics
        row = {"drift/localize/kind": m["kind"], "drift/localize/explained_by": m["explained_by"] or m["first_layer"],
               "drift/localize/seconds": m["localize_seconds"]}
        self.pending.update(row)
        if self.rows:
            self.rows[-1].update(row)
        log.warning("trainprobes drift localize: %s", r.message)
        self.results.append(r)

    def _result(self, mon: DriftMonitor, name: str, alpha: float, step: int) -> Result:
        r = mon.summary(alpha=alpha)
        r.probe = PROBE
        r.target = f"watch:grpo[{name}]"
        changed, n = self.clip[name]
        args = self.trainer.args
        r.metrics["trl_is_changed_share"] = changed / n if n else math.nan
        trunc = truncation_of(self.sampling)
        t_sampler, t_trainer = self.sampling.get("temperature"), getattr(args, "temperature", None)
        if t_sampler is not None and t_trainer is not None and t_sampler != t_trainer:
            trunc.append(f"temperature={t_sampler:g} (the trainer scores with {t_trainer:g})")
        r.metrics["sampling_differs"] = bool(trunc)
        r.evidence.update({
            "step": step, "look": self.looks, "alpha_look": alpha, "run_alpha": self.alpha,
            "generation_batches": self.batches, "generation_batches_seen": self.seen, "every": self.every,
            "interval": self.interval, "max_sequences": self.max_sequences,
            "sampling": self.sampling, "sampling_declared": self.declared,
            "trl_importance_sampling": {
                "mode": getattr(args, "vllm_importance_sampling_mode", None),
                "clip_max": getattr(args, "vllm_importance_sampling_clip_max", None),
                "clip_min": getattr(args, "vllm_importance_sampling_clip_min", None),
                "applied_by_trl": bool(getattr(args, "use_vllm", False)
                                       and getattr(args, "vllm_importance_sampling_correction", False))},
            "trainer_precision": "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False)
            else "fp32",
            "found_at_batch": self.found_at.get(name), "own_errors": self.error_count,
            "own_error_messages": list(self.errors), "own_seconds": self.own_seconds,
            "correction": "alpha * 6/(pi^2 k^2) / 2 at look k (union bound over looks; interval and run)"})
        r.message = f"{name}, {self.batches} generation batches (trainer step {step}): {r.message}; TRL's IS ({r.evidence['trl_importance_sampling']['mode']}, " \
                    f"cap {r.evidence['trl_importance_sampling']['clip_max']}) would change " \
                    f"{r.metrics['trl_is_changed_share']:.2%} of tokens"
        if trunc:
            r.message += (f"; the sampler draws with {', '.join(trunc)} while the trainer scores the full "
                          "softmax: off-policy even where the log-probs agree")
            if r.verdict == "pass":
                r.verdict = "warn"
        return r

    # --- TrainerCallback -------------------------------------------------------------------

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The last look's numbers join the logs being written (the reporters called after
        this callback and state.log_history see them)."""
        if not self.pending or logs is None:
            return
        logs.update(self.pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.pending)
        self.pending = {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and self.batches == 0 and self.trainer is None and not self.errors:
            self._own_error("step 1", InvalidArgument(
                "the monitor saw no generation batch in the first step: pass "
                "rollout_func=monitor.wrap(your_rollout_func) to GRPOTrainer"))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> list[Result]:
        """The run's final Result (all its tokens, at the next look's level) and the report.
        A monitor that scored nothing cannot judge: an error Result, never a pass."""
        if self._closed:
            return self.results
        self._closed = True
        try:
            if self.run.steps == 0:
                self.results.append(Result(
                    probe=PROBE, target="watch:grpo[run]", verdict="error", seed=None,
                    metrics={"biased": None, "n_tokens": 0}, codes=["TP-E1"],
                    evidence={"own_errors": self.error_count, "own_error_messages": list(self.errors)},
                    message=f"the monitor scored no generation batch ({self.error_count} errors of its own"
                            + (f", first: {self.errors[0]}" if self.errors else "") + "): nothing judged"))
            else:
                a = look_alpha(self.alpha, self.looks + 1, 2)
                step = int(getattr(self.trainer.state, "global_step", 0))
                r = self._result(self.run, "run", a, step)
                if r.metrics["biased"] and "run" not in self.found_at:
                    self.found_at["run"] = self.batches
                    r.evidence["found_at_batch"] = self.batches
                self.results.append(r)
        except Exception as e:
            self._own_error("closing", e)
        self._write()
        return self.results

    def _own_error(self, where: str, e: BaseException) -> None:
        msg = f"generation batch {self.batches}, {where}: {type(e).__name__}: {e}"
        self.errors.append(msg)
        del self.errors[:-100]
        self.error_count += 1
        log.warning("trainprobes drift monitor (its own error, the run goes on): %s", msg)
        if self.stop_on_finding:
            raise e

    def reported(self) -> list[Result]:
        """One Result per target, as the gate matches them (probe::target): the latest, unless
        an earlier one was a finding and the latest is not (the finding stays)."""
        out: dict = {}
        for r in self.results:
            kept = out.get(r.key)
            if kept is None or not (kept.verdict == "fail" and r.verdict != "fail"):
                out[r.key] = r
        return list(out.values())

    def _write(self) -> None:
        # every rank judges its own completions; the main process writes the report
        main = self.trainer is None or getattr(self.trainer.accelerator, "is_main_process", True)
        if self.report is None or not main:
            return
        try:
            save_results(self.report, self.reported(), command="watch.grpo",
                         options={"interval": self.interval, "alpha": self.alpha, "every": self.every,
                                  "max_sequences": self.max_sequences, "sampling": self.declared,
                                  "stop_on_finding": self.stop_on_finding,
                                  "localize": self.localize is not None, "localize_max": self.localize_max,
                                  "localize_sequences": self.localize_sequences,
                                  "localize_length": self.localize_length, "localize_at": self.localize_at, **{
                                      k: v for k, v in self.monitor_options.items()}},
                         looks=self.rows)
        except Exception as e:
            self.errors.append(f"writing {self.report}: {e}")
            self.error_count += 1
            log.warning("trainprobes drift monitor could not write %s: %s", self.report, e)
