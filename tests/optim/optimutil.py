"""Shared helpers for the fused-optimizer tests: twin parameter sets, bitwise comparison, ranks."""

from __future__ import annotations

from typing import Callable, List, Sequence

import pytest
import torch


def make_params(
    dtype: torch.dtype = torch.float32, seed: int = 0, gap: bool = True
) -> List[torch.nn.Parameter]:
    """Parameters with awkward layouts: odd sizes, channels_last, a transpose, a strided slice.

    torch's own fused=True kernels walk ``data_ptr()`` linearly and so mis-handle a parameter with
    gaps between its elements; ``gap=False`` replaces that one by a dense tensor.
    """
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    conv = r(4, 3, 3, 3).to(memory_format=torch.channels_last)
    tr = r(6, 5).t()  # non-contiguous, dense
    holes = r(5, 8)[:, ::2] if gap else r(5, 4)  # non-contiguous with gaps
    tensors = [r(7), r(3, 5), conv, tr, holes, r(1), r(33), r(130), r(2, 17)]
    return [torch.nn.Parameter(t) for t in tensors]


def twin(params: Sequence[torch.Tensor]) -> List[torch.nn.Parameter]:
    """Same values and same strides."""
    out = []
    for p in params:
        q = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
        q.copy_(p.detach())
        out.append(torch.nn.Parameter(q))
    return out


def make_grads(params: Sequence[torch.Tensor], step: int, none_every: int = 5) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    grads = []
    for i, p in enumerate(params):
        if none_every and (step + i) % none_every == 0:
            grads.append(None)
        else:
            # autograd's layout contract: a dense parameter's gradient has the parameter's strides
            gr = torch.empty_like(p.detach())
            gr.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
            grads.append(gr)
    return grads


def set_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Assign gradients the way backward() does: accumulate into an existing grad, else set it."""
    for p, gr in zip(params, grads):
        if gr is None:
            p.grad = None
        elif p.grad is None:
            p.grad = gr.clone(memory_format=torch.preserve_format)
        else:
            p.grad.copy_(gr)


def require_kernel(kind: str, flavour: str, dtype: torch.dtype = torch.float32) -> None:
    """Skip a test about the compiled ``kind`` kernel ("sgd", "adam") where it does not reproduce
    torch's ``flavour`` path ("loop", "foreach", "fused"): fuse_step then steps through torch there
    (exactness itself is still tested: test_exact.py::test_exact_where_torch_runs_without_fma)."""
    from trainloom.optim import fused

    if not fused._kernel_verified(kind, flavour, dtype):
        pytest.skip(
            f"the compiled {kind} kernel does not reproduce torch's {flavour} path for {dtype} on this "
            f"machine (torch CPU capability {torch.backends.cpu.get_cpu_capability()}): "
            "fuse_step uses torch here"
        )


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bitwise(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], what: str = "param") -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"{what} {i}: shape {x.shape} vs {y.shape}"
        if not torch.equal(bits(x), bits(y)):
            diff = (x.detach() != y.detach()).sum().item()
            raise AssertionError(f"{what} {i} differs in {diff} of {x.numel()} elements")


def run_pair(
    make_opt: Callable[[List], torch.optim.Optimizer],
    fused_step: Callable[[torch.optim.Optimizer, int], None],
    steps: int,
    dtype: torch.dtype = torch.float32,
    none_every: int = 5,
    gap: bool = True,
):
    """Run an unfused reference and a fused twin for `steps`; return both param lists and opts."""
    from trainloom.optim import fuse_optimizer

    ref = make_params(dtype, gap=gap)
    fus = twin(ref)
    opt_r = make_opt(ref)
    opt_f = fuse_optimizer(make_opt(fus))
    for s in range(steps):
        grads = make_grads(ref, s, none_every)
        set_grads(ref, grads)
        set_grads(fus, grads)
        opt_r.step()
        fused_step(opt_f, s)
        if s % 3 == 2:
            opt_r.zero_grad()
            opt_f.zero_grad()
    return ref, fus, opt_r, opt_f


def groups(params: Sequence[torch.Tensor], kw1: dict, kw2: dict) -> list:
    """Two param groups with different hyper-parameters."""
    return [dict(params=list(params[:5]), **kw1), dict(params=list(params[5:]), **kw2)]


def ddp_rank(rank: int, world_size: int, steps: int, frozen_until: int = 0) -> bool:
    """A DDP-style flow: gradients of the fused model are averaged by one all_reduce on the flat
    gradient buffer; a per-tensor twin averages per parameter. Returns bitwise equality.

    With ``frozen_until`` the first layer does not require grad when the optimizer is fused and is
    unfrozen at that step (gradual unfreezing): its gradient must reach the flat buffer too."""
    import torch.distributed as dist

    from trainloom.optim import flat_buffers, fuse_optimizer

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        twin_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        twin_model.load_state_dict(model.state_dict())
        for m in (model, twin_model):
            m[0].requires_grad_(frozen_until == 0)
        opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        ref = torch.optim.AdamW(twin_model.parameters(), lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(steps):
            if step == frozen_until:
                model[0].requires_grad_(True)
                twin_model[0].requires_grad_(True)
            x = torch.randn(5, 8, generator=gen)
            for m, o in ((model, opt), (twin_model, ref)):
                o.zero_grad()  # set_to_none=True: the hook must re-point grads at the flat buffer
                m(x).pow(2).sum().backward()
            for flat in flat_buffers(opt, "grad"):
                dist.all_reduce(flat)  # one collective writes every gradient
                flat.div_(world_size)
            for p in twin_model.parameters():
                if p.grad is None:
                    continue
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
            opt.fuse_step()
            ref.step()
        return all(torch.equal(bits(a), bits(b)) for a, b in zip(model.parameters(), twin_model.parameters()))
    finally:
        dist.destroy_process_group()
