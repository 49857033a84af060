"""Generate from a small RWKV-7 model: one packed prefill, then decode over a state pool.

Several requests with prompts of different lengths are prefilled in one chunked call (packed,
``cu_seqlens``); each request's final states go into its slot of a :class:`DecodeState`
(``torch_dplr.new_state_pool`` per layer, plus the token-shift states).  Every decode step
then advances all requests by one token in one call per layer (``torch_dplr.rwkv7_decode``),
reading and writing the states in place.  On a GPU the decode step is captured once as a CUDA
graph and replayed (the pool entry reads nothing on the host while a graph is captured).

``--check`` recomputes every generated position with one chunked call over prompt plus
generated tokens and reports the largest difference in the logits: prefill-then-decode must
equal one long prefill.

    python examples/generate_rwkv7.py --check                        # random weights, CPU
    python examples/generate_rwkv7.py --weights model.pt --tokens 64  # from train_rwkv7.py --save
    python examples/generate_rwkv7.py --check --state-dtype bfloat16   # bf16 state pools
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rwkv7_model import RWKV7, Config, DecodeState, perturb_  # noqa: E402


def pack(sequences: list, device):
    """Packed ``tokens [1, T]``, ``first [1, T, 1]`` and int32 ``cu_seqlens``."""
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    first = torch.zeros(int(cu[-1]))
    first[cu[:-1]] = 1
    tokens = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in sequences])
    return (tokens[None].to(device), first[None, :, None].to(device),
            cu.to(device=device, dtype=torch.int32))


def decode_runner(model, tokens, states, slots, use_graph: bool):
    """A function that runs one decode step on ``tokens`` (a static buffer) and returns its
    logits: the model's eager decode, or the replay of a CUDA graph of it."""
    def step():
        return model.decode(tokens, states, slots)

    if not use_graph:
        return step
    saved = states.clone()  # warm-up steps advance the states: put them back afterwards
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    states.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()

    def replay():
        graph.replay()
        return logits
    return replay


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", help="a file written by train_rwkv7.py --save (default: a "
                   "random toy model)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--slots", type=int, default=8, help="state pool slots (>= requests)")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate per request")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-graph", action="store_true", help="no CUDA graph on a GPU")
    p.add_argument("--check", action="store_true",
                   help="compare every decoded position with one chunked call")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the time-mix state pools' storage (bfloat16: half the bytes, the "
                        "states rounded once per step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print a JSON summary line")
    args = p.parse_args(argv)
    if args.slots < args.requests:
        p.error("--slots must be at least --requests")

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.weights:
        saved = torch.load(args.weights, map_location="cpu")
        model = RWKV7(Config(**saved["config"]))
        model.load_state_dict(saved["model"])
    else:
        model = perturb_(RWKV7(Config()), seed=args.seed)
    model = model.to(device).eval()
    cfg = model.cfg

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(cfg.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 40, (args.requests,), generator=gen)]
    # requests sit in arbitrary slots of a larger pool, as in an engine with other requests
    slots = torch.randperm(args.slots, generator=gen)[:args.requests].to(device, torch.int32)
    states = DecodeState.empty(cfg, args.slots, device,
                               state_dtype=getattr(torch, args.state_dtype))
    use_graph = device.type == "cuda" and not args.no_graph

    with torch.no_grad():
        start = time.perf_counter()
        tokens, first, cu = pack(prompts, device)
        logits = model(tokens, first, cu, prefill_states=(states, slots))
        last_logits = logits[0, cu[1:].long() - 1]
        step_tokens = last_logits.argmax(-1)
        prefill_s = time.perf_counter() - start

        static_tokens = step_tokens.clone()
        run = decode_runner(model, static_tokens, states, slots, use_graph)
        generated, decode_logits = [step_tokens], [last_logits]
        start = time.perf_counter()
        for _ in range(args.tokens - 1):
            logits = run()
            decode_logits.append(logits.clone())
            step_tokens = logits.argmax(-1)
            static_tokens.copy_(step_tokens)
            generated.append(step_tokens)
        out = torch.stack(generated, 1).cpu()  # the one host sync of the loop
        decode_s = time.perf_counter() - start

        summary = dict(requests=args.requests, tokens=args.tokens, cuda_graph=use_graph,
                       prefill_s=prefill_s, decode_s_per_token=decode_s / max(1, args.tokens - 1),
                       generated=out.tolist())
        if args.check:
            summary.update(check(model, prompts, out, torch.stack(decode_logits, 1), device))
    if args.json:
        print(json.dumps(summary))
    else:
        for n, row in enumerate(out.tolist()):
            print(f"request {n} (slot {int(slots[n])}): prompt {len(prompts[n])} tokens -> {row}")
        print(f"prefill {prefill_s * 1e3:.1f} ms, decode {summary['decode_s_per_token'] * 1e3:.2f}"
              f" ms per step{' (CUDA graph)' if use_graph else ''}")
        if args.check:
            print(f"check: max |logit difference| {summary['max_logit_error']:.2e}, "
                  f"relative RMS {summary['rms_logit_error']:.2e}, same tokens: "
                  f"{summary['same_tokens']}")
    return summary


def check(model, prompts, generated, decode_logits, device) -> dict:
    """One chunked call over each prompt plus its generated tokens: its logits at the
    positions that produced the generated tokens against the prefill-then-decode logits."""
    full = [p + g for p, g in zip(prompts, generated.tolist())]
    tokens, first, cu = pack(full, device)
    logits = model(tokens, first, cu)[0]
    ref = torch.stack([logits[int(cu[n]) + len(p) - 1: int(cu[n]) + len(p) - 1 + generated.shape[1]]
                       for n, p in enumerate(prompts)])
    diff = decode_logits.float() - ref.float()
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    return dict(max_logit_error=diff.abs().max().item(),
                rms_logit_error=rms(diff) / rms(ref.float()),
                same_tokens=bool(torch.equal(ref.argmax(-1).cpu(), generated)))


if __name__ == "__main__":
    main()
