"""DistributedOptimizer and the broadcasts, checked against one plain process.

Each check trains a small float64 model with ``hvd.DistributedOptimizer`` on rank
r's share of every batch and the same model in this process, unwrapped, on the
whole batch (gradients averaged by hand): both must end equal to 1e-9. Imported
by hvd_ops.py, which runs the checks in one job.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import elastic.horovod as hvd

CHECKS = {}
STEPS = 4
ROWS = 4  # rows of every batch per rank


def check(func):
    CHECKS[func.__name__] = func
    return func


class Net(nn.Module):
    """Two branches: ``unused_on`` ranks skip branch b (its hook never fires there)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(5, 4).double()
        self.b = nn.Linear(5, 4).double()
        self.head = nn.Linear(4, 1).double()

    def forward(self, x, use_b: bool = True, b_first: bool = False):
        if not use_b:
            return self.head(torch.tanh(self.a(x)))
        if b_first:
            return self.head(torch.tanh(self.b(x)) + torch.tanh(self.a(x)))
        return self.head(torch.tanh(self.a(x)) + torch.tanh(self.b(x)))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 5, generator=g, dtype=torch.float64), torch.randn(ROWS, 1, generator=g, dtype=torch.float64)


def loss_of(model, rank, step, **kw):
    x, y = batch(step, rank)
    return ((model(x, **kw) - y) ** 2).mean()


def reference_grads(model, n: int, step: int, unused_on=(), scale=1.0):
    """The averaged gradient of the whole batch, computed here; None for no gradient anywhere."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for k in range(n):
        model.zero_grad()
        loss_of(model, k, step, use_b=k not in unused_on).backward()
        for t, p in zip(total, model.parameters()):
            if p.grad is not None:
                t += p.grad
    for t, p in zip(total, model.parameters()):
        p.grad = t / n * scale
    return model


def same(model_a, model_b, tol=1e-9):
    diffs = [float((a - b).abs().max()) for a, b in zip(model_a.parameters(), model_b.parameters())]
    return max(diffs) <= tol, diffs


def train_pair(make_opt, n, r, *, passes=1, unused_on=(), b_first_on=(), clip=None, make_ref=None, **hvd_kw):
    model, ref = Net(), Net()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **hvd_kw)
    ref_opt = (make_ref or make_opt)(ref.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        if passes == 1:
            loss_of(model, r, step, use_b=r not in unused_on, b_first=r in b_first_on).backward()
        else:
            x, y = batch(step, r)
            for part in range(passes):
                rows = slice(part * ROWS // passes, (part + 1) * ROWS // passes)
                (((model(x[rows]) - y[rows]) ** 2).mean() / passes).backward()
        if clip is None:
            opt.step()
        else:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        reference_grads(ref, n, step, unused_on=unused_on)
        if clip is not None:
            nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
    return model, ref, opt


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@check
def optimizer_equals_one_process_float64():
    model, ref, opt = train_pair(sgd, hvd.size(), hvd.rank())
    ok, diffs = same(model, ref)
    return ok and isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD", diffs


@check
def optimizer_adam_and_hook_order_differs_per_rank():
    model, ref, _ = train_pair(lambda p: torch.optim.Adam(p, lr=0.01), hvd.size(), hvd.rank(), b_first_on=(1,))
    return same(model, ref)


@check
def optimizer_backward_passes_per_step():
    model, ref, _ = train_pair(sgd, hvd.size(), hvd.rank(), passes=2)
    return same(model, ref)


@check
def optimizer_unused_parameters_on_one_rank():
    model, ref, _ = train_pair(sgd, hvd.size(), hvd.rank(), unused_on=(0,))
    return same(model, ref)


@check
def optimizer_gradient_clipping_with_skip_synchronize():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, ref, _ = train_pair(sgd, hvd.size(), hvd.rank(), clip=0.05)
    ok, diffs = same(model, ref)
    return ok and not [w for w in caught if "skip_synchronize" in str(w.message)], diffs


@check
def optimizer_step_after_synchronize_warns_once():
    model = Net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()))
    loss_of(model, hvd.rank(), 0).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    found = [w for w in caught if "skip_synchronize" in str(w.message)]
    return len(found) == 1, [str(w.message)[:80] for w in caught]


@check
def optimizer_groups_scaling_and_compression():
    n, r = hvd.size(), hvd.rank()
    failures = []
    variants = {
        "groups=2": dict(groups=2),
        "explicit group": dict(groups="explicit"),
        "predivide": dict(gradient_predivide_factor=2.0),
        "num_groups": dict(num_groups=3),
    }
    for label, kw in variants.items():
        if kw.get("groups") == "explicit":
            probe = Net()
            kw = {}
            model, ref = Net(), Net()
            opt = hvd.DistributedOptimizer(sgd(model.parameters()), groups=[[model.a.weight, model.head.bias]])
            ref_opt = sgd(ref.parameters())
            for step in range(STEPS):
                opt.zero_grad()
                loss_of(model, r, step).backward()
                opt.step()
                reference_grads(ref, n, step)
                ref_opt.step()
            del probe
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                model, ref, _ = train_pair(sgd, n, r, **kw)
        ok, diffs = same(model, ref)
        if not ok:
            failures.append(f"{label}: {diffs}")
    summed_model, ref, _ = train_pair(lambda p: torch.optim.SGD(p, lr=0.1 / n, momentum=0.9), n, r, op=hvd.Sum,
                                      make_ref=sgd)
    ok, diffs = same(summed_model, ref)
    if not ok:
        failures.append(f"op=Sum with lr/n: {diffs}")
    fp16_model, ref, _ = train_pair(sgd, n, r, compression=hvd.Compression.fp16)
    ok, diffs = same(fp16_model, ref, tol=1e-2)
    if not ok:
        failures.append(f"fp16: {diffs}")
    return not failures, failures


@check
def optimizer_frozen_parameters():
    n, r = hvd.size(), hvd.rank()
    model = Net()
    model.b.weight.requires_grad_(False)  # frozen before wrapping: never reduced, never moved
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    frozen_before = model.b.weight.detach().clone()
    for step in range(2):
        opt.zero_grad()
        loss_of(model, r, step).backward()
        opt.step()
    ok = torch.equal(model.b.weight, frozen_before) and model.b.weight.grad is None
    # Frozen after wrapping (on every rank): its hook no longer fires, synchronize sends zeros.
    model.b.bias.requires_grad_(False)
    opt.zero_grad()
    loss_of(model, r, 5).backward()
    opt.synchronize()
    ok = ok and model.b.bias.grad is not None and float(model.b.bias.grad.abs().max()) == 0.0
    with opt.skip_synchronize():
        opt.step()
    return ok, "frozen weight unchanged, runtime-frozen bias reduced as zeros"


@check
def optimizer_checks_and_zero_grad():
    model = Net()
    failures = []
    named = list(model.named_parameters())
    for label, bad in (("duplicate", [("x", p) for _, p in named]), ("missing", named[:2]),
                       ("not tuples", [p for _, p in named])):
        try:
            hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=bad)
            failures.append(f"{label} names accepted")
        except ValueError:
            pass
    for kw in (dict(backward_passes_per_step=0), dict(op=hvd.Sum, gradient_predivide_factor=2.0)):
        try:
            hvd.DistributedOptimizer(sgd(model.parameters()), **kw)
            failures.append(f"{kw} accepted")
        except ValueError:
            pass
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    opt.zero_grad(set_to_none=False)
    loss_of(model, hvd.rank(), 0).backward()
    try:
        opt.zero_grad()
        failures.append("zero_grad between backward and step accepted")
    except AssertionError:
        pass
    try:
        loss_of(model, hvd.rank(), 0).backward()
        failures.append("a second backward pass accepted")
    except AssertionError:
        pass
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    return not failures, failures


@check
def broadcast_parameters_forms():
    r = hvd.rank()
    failures = []
    for form in ("state_dict", "named list", "list"):
        model = Net(seed=r)
        if form == "state_dict":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        elif form == "named list":
            hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
        else:
            hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
        ok, diffs = same(model, Net(seed=0), tol=0.0)
        if not ok:
            failures.append(f"{form}: {diffs}")
    try:
        hvd.broadcast_parameters(Net().named_parameters(), root_rank=0)
        failures.append("a generator was accepted")
    except ValueError:
        pass
    return not failures, failures


def _state_on_root(make_opt, lr):
    """Rank 0 trains a few local steps (state, options of its own); the others start fresh."""
    model = Net()
    opt = make_opt(model.parameters(), lr)
    if hvd.rank() == 0:
        for step in range(3):
            opt.zero_grad()
            loss_of(model, 0, step).backward()
            opt.step()
    return model, opt


def _flat_state(opt) -> dict:
    out = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"{index}.{key}"] = value.tolist() if torch.is_tensor(value) else value
    return out


@check
def broadcast_optimizer_state_sgd_momentum_and_adam():
    r = hvd.rank()
    failures = []
    makers = {
        "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "adam": lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.8, 0.99) if r == 0 else (0.9, 0.999)),
        "distributed sgd": lambda p, lr: hvd.DistributedOptimizer(torch.optim.SGD(p, lr=lr, momentum=0.5)),
    }
    for label, make in makers.items():
        if label == "distributed sgd":
            model = Net()
            opt = make(model.parameters(), 0.1 * (r + 1))
        else:
            model, opt = _state_on_root(make, 0.1 * (r + 1))
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        states = hvd.allgather_object(_flat_state(opt))
        if any(s != states[0] for s in states) or states[0]["groups"][0]["lr"] != 0.1:
            failures.append(f"{label}: {[sorted(s) for s in states]}")
        if label == "adam" and opt.param_groups[0]["betas"] != (0.8, 0.99):
            failures.append(f"adam betas {opt.param_groups[0]['betas']}")
        if label == "sgd" and "momentum_buffer" not in opt.state[model.a.weight]:
            failures.append("sgd: no momentum buffer created")
    return not failures, failures
