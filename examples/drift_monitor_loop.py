"""DriftMonitor inside an RL-style training loop, on the tiny LM engine pair.

Each step: the bf16 inference engine samples completions (KV-cache decode, left-padded
micro-batches), the fp32 trainer rescores them, the monitor takes the pair, and a
policy-gradient step with truncated-IS weights updates the trainer's model (the inference
engine gets the new weights each step, as in on-policy RL). Halfway through, a "config
change" makes the sampler report log-probs at temperature 0.8 while the trainer stays at 1:
the monitor's alarm fires and the summary shows the bias.

    python examples/drift_monitor_loop.py [--steps 8] [--bug-at 4]
"""
from __future__ import annotations

import argparse

import torch
from trainprobes.drift import DriftAlarm, DriftMonitor, truncated_is
from trainprobes.reference.models.lm import TinyLM, generate, random_prompts


def trainer_logprobs(model, prompts, completions, mask):
    """The training engine with gradients: full-sequence forward, right padding, fp32."""
    lens = [len(p) for p in prompts]
    B, T = completions.shape
    L = max(lens) + T
    ids = torch.zeros(B, L, dtype=torch.long)
    keys = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate(prompts):  # loop over sequences
        ids[b, :lens[b]], ids[b, lens[b]:lens[b] + T] = p, completions[b]
        keys[b, :lens[b] + T] = True
    logits, _ = model(ids, torch.arange(L).expand(B, L), keys)
    lp = torch.log_softmax(logits.float(), -1)
    at = torch.tensor(lens)[:, None] - 1 + torch.arange(T)[None, :]
    out = lp.gather(1, at[:, :, None].expand(B, T, lp.shape[-1])).gather(2, completions[:, :, None]).squeeze(2)
    return torch.where(mask, out, 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bug-at", type=int, default=4, help="step where the sampler starts reporting T=0.8 log-probs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model = TinyLM(seed=args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = DriftMonitor(thresholds={"mean_log_ratio": 0.02}, on_alarm="raise")
    for step in range(args.steps):
        bug = step >= args.bug_at
        prompts = random_prompts(16, seed=args.seed * 1000 + step)
        with torch.no_grad():
            ro = generate(model, prompts, max_new_tokens=16, temperature=0.8 if bug else 1.0,
                          logprobs="processed", dtype=torch.bfloat16, batch_size=4, seed=step)
        train_lp = trainer_logprobs(model, ro.prompts, ro.completions, ro.mask)
        try:
            row = monitor.update(train_lp.detach(), ro.logprobs, ro.mask)
        except DriftAlarm as alarm:
            row = monitor.history[-1]
            print(f"step {step}: ALARM {alarm}")
        print(f"step {step}: mean log-ratio {row['mean_log_ratio']:+.4f}  k3 {row['k3_kl']:.2e}  "
              f"max|p diff| {row['max_abs_prob_diff']:.3f}  outside[1/2,2] {row['frac_ratio_outside']:.2%}")
        # REINFORCE-style update with truncated IS (reward: prefer low token ids, a toy task)
        corr = truncated_is(train_lp.detach(), ro.logprobs, ro.mask, cap=2.0)
        reward = -(ro.completions.float() / 128).where(ro.mask, 0.0).sum(1, keepdim=True)
        adv = reward - reward.mean()
        loss = -(corr.weights * adv * train_lp).sum() / ro.mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    s = monitor.summary()
    print()
    print(s.summary_line())
    trend = s.evidence["trend"]["mean_log_ratio"]
    print(f"trend of mean log-ratio: first quarter {trend['first']:+.4f}, last quarter "
          f"{trend['last']:+.4f}, slope {trend['slope']:+.2e}/step (p = {trend['p_value']:.2g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
