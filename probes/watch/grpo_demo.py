"""A GRPO run on CPU for the drift monitor: a tiny random Llama, a word-level tokenizer built
in memory (no download), and a rollout_func sampler that differs from the trainer in one
realistic way at a time. Used by tests/test_drift_trl.py, examples/grpo_drift.py and
benchmarks/bench_drift_trl.py. Needs trl (pip install trl==1.16.0).

Sampler kinds (what the sampler does; the trainer always scores softmax(logits / T)):
    clean              the trainer's own module, temperature T once (under accelerate's
                       mixed precision its forward autocasts as the trainer's does)
    copy               a separate fp32 module synced every call (an engine of its own)
    temperature_twice  logits / T / T (a sampler that applies T, given logits already scaled)
    bf16               a bf16 copy of the weights, re-synced every call
    bf16_mlp           an fp32 copy whose block 1 MLP runs in bf16 (one op's numerics)
    top_p_renormalised nucleus sampling (p = 0.9), log-probs renormalised over the nucleus
    top_p_raw          nucleus sampling, raw log-probs (the full softmax's)
    stale              an fp32 copy of the weights synced only every `stale` calls
"""
from __future__ import annotations

import torch

KINDS = ("clean", "copy", "temperature_twice", "bf16", "bf16_mlp", "top_p_renormalised", "top_p_raw", "stale")
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
PROMPT_WORDS = 4


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(seed: int = 0, hidden: int = 32, layers: int = 2, init: float = 0.3, dtype=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                      initializer_range=init)  # wide enough that next-token distributions are peaked
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model if dtype is None else model.to(dtype)


def tiny_qwen2_moe(seed: int = 0, hidden: int = 32, layers: int = 2, init: float = 0.3):
    """A tiny Qwen2-MoE (8 experts, top-2, a shared expert): routing decisions that a bf16
    copy can flip."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                         moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, initializer_range=init)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2MoeForCausalLM(cfg)


MODELS = {"llama": tiny_llama, "qwen2_moe": tiny_qwen2_moe}


def _fresh(model, dtype=None):
    """A new module of the same class and config (the weights loaded by the caller); the
    global generator does not move (its random init is drawn in a forked RNG state)."""
    with torch.random.fork_rng(devices=[]):
        fresh = type(model)(model.config)
    return fresh if dtype is None else fresh.to(dtype)


def prompts(n: int = 64):
    from datasets import Dataset
    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 61}" for j in range(PROMPT_WORDS))
                                         for i in range(n)]})


class Sampler:
    """A rollout_func: samples `length` tokens per prompt (TRL passes each prompt once per
    generation) with its own generator, returns TRL's contract with the sampler's log-prob
    of each sampled token."""

    def __init__(self, kind: str, tokenizer, *, temperature: float = 0.8, top_p: float = 0.9,
                 length: int = 6, seed: int = 0, stale: int = 4):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; known: {KINDS}")
        self.kind, self.tok, self.T, self.top_p, self.length = kind, tokenizer, temperature, top_p, length
        self.generator = torch.Generator().manual_seed(seed)
        self.copy = None
        self.calls = 0
        self.stale = stale

    def _model(self, trainer):
        if self.kind not in ("bf16", "bf16_mlp", "stale", "copy"):
            return trainer.model
        if self.kind == "bf16_mlp":
            if self.copy is None:
                from trainprobes.drift.faults import in_dtype
                self.copy = _fresh(trainer.model)
                in_dtype(self.copy.model.layers[1].mlp, torch.bfloat16)
            self.copy.load_state_dict(trainer.model.state_dict())  # weight sync; the MLP's cast to bf16
            return self.copy
        if self.kind in ("stale", "copy"):
            if self.copy is None or self.kind == "copy" or (self.calls - 1) % self.stale == 0:
                self.copy = self.copy or _fresh(trainer.model)
                self.copy.load_state_dict(trainer.model.state_dict())  # the sync, every `stale` calls
            return self.copy
        if self.copy is None:
            # a fresh module, not copy.deepcopy(trainer.model): TRL's fused head wraps the
            # model's forward in a closure over the original, so a deep copy would still
            # run the trainer's fp32 weights
            self.copy = _fresh(trainer.model, torch.bfloat16)
        self.copy.load_state_dict(trainer.model.state_dict())  # weight sync, cast to bf16
        return self.copy

    def engine(self, trainer):
        """This sampler as drift localize sees it (GRPODriftMonitor(localize=sampler.engine)):
        the module it last sampled with and the log-prob function it reports with."""
        from trainprobes.drift.engines import Engine
        from trainprobes.drift.faults import temperature_logprobs, top_p_logprobs
        module = self.copy if self.copy is not None else trainer.model
        if self.kind == "temperature_twice":
            logprobs = temperature_logprobs(self.T * self.T)
        elif self.kind == "top_p_renormalised":
            logprobs = top_p_logprobs(self.top_p, self.T)
        else:
            logprobs = temperature_logprobs(self.T)
        return Engine(module, logprobs, name=f"sampler ({self.kind})")

    @torch.no_grad()
    def __call__(self, prompt_texts, trainer):
        # an inference engine runs in its own dtype, not under the trainer's autocast (TRL
        # calls rollout_func inside its training step, where bf16=True autocasts)
        with torch.autocast("cpu", enabled=False):
            return self._sample(prompt_texts, trainer)

    def _sample(self, prompt_texts, trainer):
        self.calls += 1
        model = self._model(trainer)
        ids = [self.tok(p)["input_ids"] for p in prompt_texts]
        seq = torch.tensor(ids)  # equal-length prompts: no padding
        out, lps = [], []
        for _ in range(self.length):  # a loop over positions (no KV cache: a tiny model)
            logits = model(input_ids=seq).logits[:, -1].float() / self.T
            if self.kind == "temperature_twice":
                logits = logits / self.T
            logp = torch.log_softmax(logits, -1)
            draw = logp
            if self.kind.startswith("top_p"):
                p = logp.exp()
                sp, order = p.sort(-1, descending=True)
                drop = (sp.cumsum(-1) - sp) >= self.top_p  # outside the nucleus
                kept = torch.ones_like(p, dtype=torch.bool).scatter(-1, order, ~drop)
                draw = torch.where(kept, logp, -torch.inf)
                draw = draw - torch.logsumexp(draw, -1, keepdim=True)
            t = torch.multinomial(draw.exp(), 1, generator=self.generator)
            lp = (draw if self.kind == "top_p_renormalised" else logp).gather(-1, t)
            out.append(t)
            lps.append(lp)
            seq = torch.cat([seq, t], 1)
        comp = torch.cat(out, 1)
        lp = torch.cat(lps, 1)
        return {"prompt_ids": ids, "completion_ids": comp.tolist(), "logprobs": lp.tolist()}


def reward(completions, **kwargs):
    """Words with an even index: a reward with spread, so GRPO's advantages (and the weight
    updates a stale sampler misses) are not zero."""
    return [float(sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit())) for c in completions]


def run(kind: str, *, steps: int, monitor=None, seed: int = 0, bf16: bool = False, batch: int = 8,
        generations: int = 4, temperature: float = 0.8, top_p: float | None = None, output_dir: str,
        learning_rate: float = 1e-5, quiet: bool = True, arch: str = "llama", sampler: Sampler | None = None):
    """Train `steps` GRPO steps with a `kind` sampler; returns the trainer. With a monitor,
    the two lines a user adds: rollout_func=monitor.wrap(sampler), callbacks=[monitor].
    sampler: one built beforehand (its .engine handed to GRPODriftMonitor(localize=...))."""
    import os
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer
    tok = word_tokenizer()
    if sampler is not None and (sampler.kind != kind or sampler.T != temperature):
        raise ValueError(f"sampler is {sampler.kind!r} at T={sampler.T}; run was asked for {kind!r} at T={temperature}")
    sampler = sampler or Sampler(kind, tok, temperature=temperature, seed=seed)
    if top_p is None:
        top_p = sampler.top_p if kind.startswith("top_p") else 1.0
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=batch, num_generations=generations,
                      max_completion_length=sampler.length, max_steps=steps, logging_steps=1, report_to=[],
                      temperature=temperature, top_p=top_p, bf16=bf16, use_cpu=True, save_strategy="no",
                      disable_tqdm=True, seed=seed, learning_rate=learning_rate)
    rollout = monitor.wrap(sampler) if monitor is not None else sampler
    trainer = GRPOTrainer(model=MODELS[arch](seed), reward_funcs=reward, args=args,
                          train_dataset=prompts(), processing_class=tok, rollout_func=rollout,
                          callbacks=[monitor] if monitor is not None else None)
    if quiet:  # the log rows stay in trainer.state.log_history; no printing of each
        from transformers import PrinterCallback
        trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer
