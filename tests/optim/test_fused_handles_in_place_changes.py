"""fuse_step against torch's own optimizer where a training script changes things in place or per
group: a gradient re-pointed or made with a graph before ``flat_buffers``, state tensors re-pointed
with ``.data =``, an AdamW group with ``decoupled_weight_decay=False``, and Adam with beta1 = 0 on
gradients of -0.0. Each case differed from torch before (an audit reproduced them); bits are
compared, not values.
"""

from __future__ import annotations

import warnings
from typing import Callable, List

import pytest
import torch

from trainloom.optim import flat_buffers, fuse_optimizer


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _pair(make: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer], *shapes: int):
    torch.manual_seed(0)
    w0 = [torch.randn(n) for n in shapes]
    pa = [torch.nn.Parameter(w.clone()) for w in w0]
    pb = [torch.nn.Parameter(w.clone()) for w in w0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pa, make(pa), pb, fuse_optimizer(make(pb))


def _backward(ps: List[torch.nn.Parameter], gs: List[torch.Tensor], create_graph: bool = False) -> None:
    # p * p: the gradient depends on p, so create_graph=True gives it a graph
    sum(((p * p * g).sum() for p, g in zip(ps, gs)), torch.zeros(())).backward(create_graph=create_graph)


@pytest.mark.parametrize("how", ["grad.data re-pointed", "backward(create_graph=True)"])
def test_flat_buffers_take_in_a_gradient_of_its_own_so_the_collective_reaches_it(how):
    # A collective on the flat gradient buffer (here: averaging two identical ranks, * 0.5) must
    # reach every gradient: such gradients stayed out of their slots, and fuse_step stepped with
    # the un-reduced values.
    pa, oa, pb, ob = _pair(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 12, 5)
    for _ in range(3):
        gs = [torch.randn(12), torch.randn(5)]
        for ps, opt in ((pa, oa), (pb, ob)):
            opt.zero_grad()
            _backward(ps, gs, create_graph=how.startswith("backward"))
            if how.startswith("grad.data"):
                ps[0].grad.data = ps[0].grad.data * 3
        with torch.no_grad():
            for p in pa:
                p.grad.mul_(0.5)
            (flat,) = flat_buffers(ob, "grad")
            flat.mul_(0.5)
        oa.step()
        ob.fuse_step()
        assert all(_same(a, b) for a, b in zip(pa, pb))


@pytest.mark.parametrize(
    "make, keys",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ["momentum_buffer"]),
        (lambda ps: torch.optim.Adam(ps, lr=0.01), ["exp_avg", "exp_avg_sq"]),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), ["sum"]),
    ],
    ids=["SGD", "Adam", "Adagrad"],
)
def test_state_tensors_re_pointed_with_data_keep_being_the_state_that_is_stepped(make, keys):
    # The forum's "move the optimizer state" snippet does v.data = v.data.to(device): here the same
    # device, new storage, a no-op for torch. fuse_step kept stepping the flat buffer while
    # opt.state (and state_dict) held the re-pointed tensors, never updated again.
    pa, oa, pb, ob = _pair(make, 12, 7)
    for step in range(5):
        gs = [torch.randn(12), torch.randn(7)]
        for ps, opt in ((pa, oa), (pb, ob)):
            opt.zero_grad()
            _backward(ps, gs)
            if step == 2:
                for st in opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and v.dim() > 0:
                            v.data = v.data.clone()
        oa.step()
        ob.fuse_step()
        assert all(_same(a, b) for a, b in zip(pa, pb)), step
        for a, b in zip(pa, pb):
            assert all(_same(oa.state[a][k], ob.state[b][k]) for k in keys), step
    resumed = make([torch.nn.Parameter(p.detach().clone()) for p in pb])
    resumed.load_state_dict(ob.state_dict())
    for a, (_, st) in zip(pa, sorted(resumed.state.items(), key=lambda kv: kv[0].numel(), reverse=True)):
        assert all(_same(oa.state[a][k], st[k]) for k in keys)


def test_an_adamw_group_with_decoupled_weight_decay_false_gets_l2_decay_as_in_torch():
    # torch reads the flag per group (AdamW's groups default to True); fuse_step took every AdamW
    # group as decoupled.
    torch.manual_seed(0)
    w0 = [torch.randn(10), torch.randn(6)]
    pa = [torch.nn.Parameter(w.clone()) for w in w0]
    pb = [torch.nn.Parameter(w.clone()) for w in w0]
    oa = torch.optim.AdamW([pa[0]], lr=0.01, weight_decay=0.1)
    oa.add_param_group({"params": [pa[1]], "decoupled_weight_decay": False})
    ob = torch.optim.AdamW([pb[0]], lr=0.01, weight_decay=0.1)
    ob.add_param_group({"params": [pb[1]], "decoupled_weight_decay": False})
    ob = fuse_optimizer(ob)
    for _ in range(4):
        gs = [torch.randn(10), torch.randn(6)]
        for ps, opt in ((pa, oa), (pb, ob)):
            opt.zero_grad()
            _backward(ps, gs)
        oa.step()
        ob.fuse_step()
        assert all(_same(a, b) for a, b in zip(pa, pb))
        assert _same(oa.state[pa[1]]["exp_avg"], ob.state[pb[1]]["exp_avg"])


@pytest.mark.parametrize("flavour", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("n", [9, 16, 37])
def test_adam_with_beta1_zero_keeps_torchs_zero_signs(flavour, n):
    # exp_avg.lerp_(grad, 1): ATen's scalar tail (the last numel % 16 float32 elements, all of a
    # 9-element tensor) gives +0.0 for a -0.0 gradient, its vector loop -0.0; the kernel gave -0.0
    # everywhere (betas=(0, 0.99) is common in GAN training; a dead ReLU gives -0.0 gradients).
    kw = {"foreach": flavour == "foreach", "fused": flavour == "fused"}
    pa, oa, pb, ob = _pair(lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.0, 0.99), **kw), n)
    for g in (torch.ones(n), torch.full((n,), -0.0), torch.randn(n)):
        for ps in (pa, pb):
            ps[0].grad = g.clone()
        oa.step()
        ob.fuse_step()
        assert _same(oa.state[pa[0]]["exp_avg"], ob.state[pb[0]]["exp_avg"])
        assert _same(pa[0], pb[0])
