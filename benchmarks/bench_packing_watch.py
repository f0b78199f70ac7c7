"""What the packing watch costs (docs/watch.md, "Packed documents on the run's own batches").

    python benchmarks/bench_packing_watch.py [--steps 200]

1. reading a batch's convention (trainprobes.watch.convention.convention_of), per batch, on
   batches of several sizes and conventions;
2. a tiny Llama (2 layers, hidden 64) trained on flattened batches beside an all-ones mask,
   steps with the watch's pre-hook and without, interleaved in one run: the watch's own time
   per step (counted by the watch) and the paired wall difference; then the one check the
   run makes (d + 2 forwards in eval mode).
"""
import argparse
import statistics
import time

import torch
from trainprobes.watch import Sentinel
from trainprobes.watch.convention import convention_of
from trainprobes.watch.packing_watch import watch_packing


def flattened(B, L, doc, mask):
    pos = (torch.arange(L) % doc)[None].expand(B, L).contiguous()
    b = {"input_ids": torch.randint(0, 128, (B, L)), "labels": torch.randint(0, 128, (B, L)),
         "position_ids": pos}
    if mask == "2d":
        b["attention_mask"] = torch.ones(B, L, dtype=torch.long)
    elif mask == "4d":
        d = (pos == 0).long().cumsum(-1)
        keep = torch.ones(L, L, dtype=torch.bool).tril() & (d[:, :, None] == d[:, None, :])
        b["attention_mask"] = keep[:, None]
    return b


def time_convention(reps: int):
    for B, L, doc, mask in [(1, 512, 50, "none"), (1, 8192, 300, "2d"), (8, 4096, 300, "2d"),
                            (2, 2048, 300, "4d")]:
        b = flattened(B, L, doc, mask)
        convention_of(b)
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            convention_of(b)
            t.append(time.perf_counter() - t0)
        print(f"convention_of  B={B} L={L} mask={mask:4s}: median {statistics.median(t) * 1e6:7.1f} us")


def time_steps(steps: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      use_cache=False)
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    s = Sentinel()
    w = watch_packing(model, s)
    batches = [flattened(1, 256, int(d), "2d") for d in torch.randint(20, 60, (steps,))]
    on, off, own = [], [], []
    for i, b in enumerate(batches):  # interleaved: the hook on at even steps
        watching = i % 2 == 0
        w._busy = not watching  # off: the hook returns at once (its cheapest path)
        before = w.seconds["convention"]
        t0 = time.perf_counter()
        model(**b).loss.backward()
        t1 = time.perf_counter()
        if watching:
            w.check_pending()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        (on if watching else off).append((t1 - t0 + time.perf_counter() - t2, t2 - t1))
        if watching and i:
            own.append(w.seconds["convention"] - before)
        s.step()
    w._busy = False
    step_on = statistics.median(a for a, _ in on[1:])
    step_off = statistics.median(a for a, _ in off[1:])
    mean = statistics.mean(own)
    own = statistics.median(own)  # a seen convention: read, looked up, nothing else
    print(f"tiny Llama, 1x256 tokens: step {step_off * 1e3:.2f} ms without, {step_on * 1e3:.2f} ms "
          f"with the hook (medians, the check excluded); the watch's own time per step: median "
          f"{own * 1e6:.0f} us ({own / step_off:.2%}), mean {mean * 1e6:.0f} us "
          f"({mean / step_off:.2%}); {w.summary()}")
    print(f"the one check (step 0, {len(s.results[0].evidence['documents'])} documents): "
          f"{w.seconds['check'] * 1e3:.0f} ms = {w.seconds['check'] / step_off:.1f} steps")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(1)
    time_convention(200)
    time_steps(a.steps)


if __name__ == "__main__":
    main()
