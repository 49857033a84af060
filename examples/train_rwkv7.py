"""Train a small RWKV-7 language model with torch_dplr.

The model (``rwkv7_model.py``) is plain PyTorch; its attention is ``torch_dplr.chunk_rwkv7``.
The whole forward and loss are compiled with ``torch.compile(fullgraph=True)``; each time mix
runs under ``torch.utils.checkpoint`` with a shipped selective-checkpoint policy
(``torch_dplr.policies.context_fn``).  Batches are packed: several sequences of different
lengths in one row, delimited by ``cu_seqlens``; token shift and the recurrence restart at
every sequence start.

Data is synthetic by default (no downloads): sequences drawn from a random sparse Markov
chain, whose entropy the loss falls towards.  ``--text FILE`` trains on the bytes of a file.

    python examples/train_rwkv7.py                    # toy size: seconds on a CPU
    python examples/train_rwkv7.py --size small       # a GPU-sized run (bf16 autocast on CUDA)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rwkv7_model import RWKV7, Config  # noqa: E402

SIZES = {  # model config, tokens per packed row, sequences per row, steps
    "toy": (Config(vocab_size=64, d_model=64, n_layers=2, head_dim=16, chunk_size=16,
                   lora_dim=16), 256, 4, 60),
    "small": (Config(vocab_size=256, d_model=512, n_layers=6, head_dim=64, chunk_size=64,
                     lora_dim=64), 8192, 8, 2000),
}


class MarkovData:
    """Windows of random Markov chains where each token has ``fanout`` likely successors: a
    model that learns the table reaches a loss near ``log(fanout)`` nats.  The chains are
    drawn once, all at a time."""

    def __init__(self, vocab: int, longest: int, fanout: int = 3, chains: int = 16,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        successors = torch.stack([torch.randperm(vocab, generator=g)[:fanout]
                                  for _ in range(vocab)])
        length = 4 * longest
        picks = torch.randint(fanout, (chains, length), generator=g)
        self.chains = torch.empty(chains, length, dtype=torch.long)
        self.chains[:, 0] = torch.randint(vocab, (chains,), generator=g)
        for t in range(1, length):
            self.chains[:, t] = successors[self.chains[:, t - 1], picks[:, t]]
        self.gen = g

    def sequence(self, length: int) -> torch.Tensor:
        chain = torch.randint(self.chains.shape[0], (1,), generator=self.gen).item()
        start = torch.randint(self.chains.shape[1] - length + 1, (1,), generator=self.gen).item()
        return self.chains[chain, start:start + length]


class TextData:
    """Random windows of a file's bytes (vocabulary 256)."""

    def __init__(self, path: str, seed: int = 0):
        with open(path, "rb") as f:
            self.data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        self.gen = torch.Generator().manual_seed(seed)

    def sequence(self, length: int) -> torch.Tensor:
        start = torch.randint(max(1, len(self.data) - length), (1,), generator=self.gen).item()
        return self.data[start:start + length]


def packed_batch(data, tokens: int, sequences: int, gen: torch.Generator):
    """``sequences`` sequences of random lengths packed into one row of ``tokens`` tokens.

    Returns ``tokens [1, T]``, ``targets [1, T]`` (next token of the same sequence, -100 at
    each sequence's end), ``first [1, T, 1]`` (1 at each sequence's first token) and
    ``cu_seqlens [N+1]`` (int32).  The row length and sequence count are fixed, so compiled
    code sees one shape; only the boundaries move.
    """
    cuts = torch.randperm(tokens - 1, generator=gen)[:sequences - 1].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    x = torch.empty(tokens, dtype=torch.long)
    y = torch.full((tokens,), -100, dtype=torch.long)
    first = torch.zeros(tokens)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seq = data.sequence(end - start + 1)
        x[start:end], y[start:end] = seq[:-1], seq[1:]
        first[start] = 1
    y[cu[1:] - 1] = -100  # the last token's successor lies outside the sequence
    return x[None], y[None], first[None, :, None], cu.to(torch.int32)


def progress(steps: int, enabled: bool):
    """A tqdm bar when tqdm is installed, else plain lines; ``update(loss, tokens_per_s)``."""
    if not enabled:
        return lambda loss, tps: None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=steps, desc="train", file=sys.stderr, dynamic_ncols=True)

        def update(loss, tps):
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
            bar.update(1)
        return update, bar.close
    count = [0]

    def update(loss, tps):
        count[0] += 1
        if count[0] % 10 == 0 or count[0] == steps:
            print(f"step {count[0]}/{steps}  loss {loss:.3f}  {tps:,.0f} tok/s", file=sys.stderr,
                  flush=True)
    return update, lambda: None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="toy")
    p.add_argument("--steps", type=int, help="training steps (default: the size's)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--policy", default="save_state",
                   help="checkpoint policy for each time mix (torch_dplr.policies), or 'none'")
    p.add_argument("--backend", help="torch.compile backend (default: inductor on CUDA; on a CPU "
                   "aot_eager, the same fullgraph capture and checkpoint partition without "
                   "Inductor's C++ code generation, which takes about a minute on 2 cores)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly")
    p.add_argument("--text", help="train on this file's bytes instead of synthetic data")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the trained weights and config here")
    p.add_argument("--json", action="store_true", help="print a JSON summary line at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    cfg, tokens, sequences, steps = SIZES[args.size]
    steps = args.steps or steps
    torch.manual_seed(args.seed)
    if args.text:
        data = TextData(args.text, args.seed)
        cfg = Config(**{**cfg.__dict__, "vocab_size": 256})
    else:
        data = MarkovData(cfg.vocab_size, longest=tokens + 1, seed=args.seed)
    device = torch.device(args.device)
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    model = RWKV7(cfg, None if args.policy == "none" else args.policy).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loss_fn = model if args.no_compile else torch.compile(model, fullgraph=True,
                                                          backend=backend)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed + 1)

    update, close = progress(steps, not args.quiet)
    losses, start, timed_tokens, timed_seconds = [], time.perf_counter(), 0, 0.0
    for step in range(steps):
        x, y, first, cu = (t.to(device) for t in packed_batch(data, tokens, sequences, gen))
        t0 = time.perf_counter()
        with autocast:
            loss = loss_fn(x, first, cu, targets=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()  # syncs: the step's time is complete
        seconds = time.perf_counter() - t0
        if step > 0:  # the first step compiles
            timed_tokens, timed_seconds = timed_tokens + tokens, timed_seconds + seconds
        losses.append(value)
        update(value, tokens / seconds)
    close()

    window = max(1, min(10, steps // 4))
    summary = dict(initial_loss=losses[0], first_loss=sum(losses[:window]) / window,
                   last_loss=sum(losses[-window:]) / window,
                   uniform_loss=math.log(cfg.vocab_size), steps=steps,
                   tokens_per_s=timed_tokens / timed_seconds if timed_seconds else None,
                   seconds=time.perf_counter() - start)
    if args.save:
        torch.save(dict(config=cfg.__dict__, model=model.state_dict()), args.save)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
              f"(uniform {summary['uniform_loss']:.3f}) in {summary['seconds']:.1f} s")
    return summary


if __name__ == "__main__":
    main()
