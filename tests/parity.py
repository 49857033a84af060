"""Run the composed op and the fp64 oracle on the same inputs; report error ratios per output."""
from __future__ import annotations

import torch

import torch_dplr
from torch_dplr.testing import make_inputs, recurrence_oracle, rms_ratio

GRAD_NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


def parity_errors(B, T, H, K, V=None, *, dtype=torch.float32, gates="rwkv7", chunk_size=64,
                  cu_seqlens=None, use_state=True, lower_bound=None, seed=0, device="cpu",
                  fn=None, scale=None):
    """Error ratios {name: RMS(err)/RMS(ref)} for o, final state and every input gradient.

    The oracle sees the same (dtype-rounded) inputs upcast to fp64, so the ratios measure
    the op's own error.
    """
    fn = fn or torch_dplr.chunk_dplr_delta_rule
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    inp = make_inputs(B, T, H, K, V, dtype=dtype, gates=gates, seed=seed, device=device,
                      num_states=N)
    if not use_state:
        inp["initial_state"] = None
    names = [n for n in GRAD_NAMES if inp[n] is not None]
    ours = {n: inp[n].detach().clone().requires_grad_() for n in names}
    theirs = {n: inp[n].detach().double().clone().requires_grad_() for n in names}
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    scale_ = K ** -0.5 if scale is None else scale
    o, ht = fn(ours["q"], ours["k"], ours["v"], ours["a"], ours["b"], ours["gk"], scale=scale_,
               initial_state=ours.get("initial_state"), output_final_state=True,
               cu_seqlens=cu, chunk_size=chunk_size, lower_bound=lower_bound)
    o_ref, ht_ref = recurrence_oracle(theirs["q"], theirs["k"], theirs["v"], theirs["a"],
                                      theirs["b"], theirs["gk"], scale_,
                                      theirs.get("initial_state"), cu)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(device)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64).to(device)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    grads = torch.autograd.grad(loss, [ours[n] for n in names])
    ref_grads = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(),
                                    [theirs[n] for n in names])
    errors = {"o": rms_ratio(o, o_ref), "final_state": rms_ratio(ht, ht_ref)}
    for n, g, r in zip(names, grads, ref_grads):
        if not torch.isfinite(g).all():
            raise AssertionError(f"non-finite gradient for {n}")
        errors["d" + n] = rms_ratio(g, r)
    if not (torch.isfinite(o).all() and torch.isfinite(ht).all()):
        raise AssertionError("non-finite output")
    return errors
