"""A Horovod-API script for tests/integration/test_horovod_api.py: many checks, one job.

Run by the real ``elastic-run`` on 2-3 gloo workers. Every check computes what
Horovod's semantics say the result must be and what ``elastic.horovod`` gave;
each rank writes ``{"rank", "size", "checks": {name: {"ok", "detail"}}}`` to
``<out>/rank<r>.json``. The optimizer checks live in hvd_optimizer_checks.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import elastic.horovod as hvd  # noqa: E402
from tests.fakes import hvd_optimizer_checks  # noqa: E402

CHECKS = {}


def check(func):
    CHECKS[func.__name__] = func
    return func


def close(a, b, tol=1e-9) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=tol)


def mine(r: int) -> torch.Tensor:
    """Rank r's input to the reductions: different on every rank, negative values too."""
    return torch.tensor([r + 1.0, -2.0 * r - 0.5, 3.0 ** r], dtype=torch.float64)


@check
def environment():
    r, n = hvd.rank(), hvd.size()
    env = {k: os.environ.get("HOROVOD_" + k) for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE",
                                                        "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")}
    ok = (env["RANK"] == str(r) and env["SIZE"] == str(n) and env["LOCAL_SIZE"] == str(n)
          and env["CROSS_SIZE"] == "1" and env["CROSS_RANK"] == "0" and bool(env["HOSTNAME"])
          and (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (r, n, 0, 1)
          and hvd.is_homogeneous())
    return ok, env


@check
def allreduce_every_op_and_scale():
    r, n = hvd.rank(), hvd.size()
    inputs = torch.stack([mine(k) for k in range(n)])
    expected = {hvd.Sum: inputs.sum(0), hvd.Average: inputs.mean(0), hvd.Min: inputs.min(0).values,
                hvd.Max: inputs.max(0).values, hvd.Product: inputs.prod(0)}
    failures = []
    for op, want in expected.items():
        for pre, post in ((1.0, 1.0), (2.0, 1.0), (1.0, 0.25), (3.0, 0.5)):
            if op in (hvd.Min, hvd.Max) and pre != 1.0:
                scaled = inputs * pre
                want_scaled = (scaled.min(0).values if op == hvd.Min else scaled.max(0).values) * post
            elif op == hvd.Product:
                want_scaled = (inputs * pre).prod(0) * post
            else:
                want_scaled = want * pre * post
            x = mine(r)
            got = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
            if not close(got, want_scaled, 1e-9) or not torch.equal(x, mine(r)):
                failures.append(f"op {op} pre {pre} post {post}: {got.tolist()} != {want_scaled.tolist()}")
    return not failures, failures


@check
def allreduce_default_is_average_and_deprecated_average_flag():
    r, n = hvd.rank(), hvd.size()
    inputs = torch.stack([mine(k) for k in range(n)])
    default = hvd.allreduce(mine(r))
    summed = hvd.allreduce(mine(r), average=False)
    averaged = hvd.allreduce(mine(r), average=True)
    ok = close(default, inputs.mean(0)) and close(summed, inputs.sum(0)) and close(averaged, inputs.mean(0))
    return ok, [default.tolist(), summed.tolist()]


@check
def integer_average_truncates():
    r, n = hvd.rank(), hvd.size()
    values = [[3 * k + 1, -(2 * k + 1)] for k in range(n)]
    got = hvd.allreduce(torch.tensor(values[r], dtype=torch.int64), op=hvd.Average)
    want = [math.trunc(sum(v[i] for v in values) / n) for i in range(2)]
    return got.tolist() == want and got.dtype == torch.int64, [got.tolist(), want]


@check
def in_place_and_async_forms():
    r, n = hvd.rank(), hvd.size()
    want = torch.stack([mine(k) for k in range(n)]).sum(0)
    a = mine(r)
    returned = hvd.allreduce_(a, op=hvd.Sum)
    b = mine(r)
    handle = hvd.allreduce_async_(b, op=hvd.Sum)
    from_handle = hvd.synchronize(handle)
    c = mine(r)
    handle = hvd.allreduce_async(c, op=hvd.Sum, postscale_factor=2.0)
    while not hvd.poll(handle):
        pass
    out = hvd.synchronize(handle)
    ok = (returned is a and close(a, want) and from_handle is b and close(b, want)
          and close(out, want * 2) and torch.equal(c, mine(r)))
    return ok, [a.tolist(), out.tolist()]


@check
def grouped_allreduce_mixed_dtypes():
    r, n = hvd.rank(), hvd.size()
    tensors = [mine(r).float(), mine(r), torch.tensor([r, 10 * r], dtype=torch.int32), mine(r)[:2]]
    got = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    want = [torch.stack([t.float() if i == 0 else t for t in
                         ([mine(k).float(), mine(k), torch.tensor([k, 10 * k], dtype=torch.int32), mine(k)[:2]][i]
                          for k in range(n))]).sum(0).to(tensors[i].dtype) for i in range(4)]
    in_place = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(in_place, op=hvd.Sum)
    handle = hvd.grouped_allreduce_async([t.clone() for t in tensors], op=hvd.Average)
    averaged = hvd.synchronize(handle)
    ok = all(torch.allclose(g, w.to(g.dtype), atol=1e-5) and g.dtype == t.dtype for g, w, t in zip(got, want, tensors))
    ok = ok and all(torch.allclose(a, w.to(a.dtype), atol=1e-5) for a, w in zip(in_place, want))
    ok = ok and torch.allclose(averaged[1], want[1] / n) and averaged[2].tolist() == [int(v / n) for v in want[2].tolist()]
    return ok, [g.tolist() for g in got]


@check
def fp16_compression():
    r, n = hvd.rank(), hvd.size()
    x = torch.tensor([0.5 + r, 1.25 * r], dtype=torch.float32)
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    want = torch.stack([torch.tensor([0.5 + k, 1.25 * k]) for k in range(n)]).sum(0)
    return got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-2), got.tolist()


@check
def allgather_uneven_first_dimension():
    r, n = hvd.rank(), hvd.size()
    x = torch.full((r + 1, 2), float(r), dtype=torch.float64)
    got = hvd.allgather(x)
    want = torch.cat([torch.full((k + 1, 2), float(k), dtype=torch.float64) for k in range(n)])
    handle = hvd.allgather_async(torch.arange(r + 2, dtype=torch.int32))
    ints = hvd.synchronize(handle)
    want_ints = torch.cat([torch.arange(k + 2, dtype=torch.int32) for k in range(n)])
    grouped = hvd.grouped_allgather([x, torch.tensor([r])])
    ok = close(got, want) and torch.equal(ints, want_ints) and close(grouped[0], want) \
        and grouped[1].tolist() == list(range(n))
    return ok, got.shape[0]


@check
def broadcast_forms():
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    got = hvd.broadcast(mine(r), root)
    in_place = mine(r)
    hvd.broadcast_(in_place, root_rank=root)
    handle = hvd.broadcast_async_(mine(r) * 2, 0)
    from_zero = hvd.synchronize(handle)
    ok = close(got, mine(root)) and close(in_place, mine(root)) and close(from_zero, mine(0) * 2)
    return ok, got.tolist()


def rows_for(sender: int, n: int) -> tuple[list, torch.Tensor]:
    """Sender's splits (rows per destination) and its rows (value sender*1000 + row)."""
    splits = [(sender + d) % n + 1 for d in range(n)]
    rows = torch.arange(sum(splits), dtype=torch.float64) + sender * 1000
    return splits, torch.stack([rows, -rows], dim=1)


@check
def alltoall_with_and_without_splits():
    r, n = hvd.rank(), hvd.size()
    equal = torch.stack([torch.arange(2 * n, dtype=torch.float64) + 100 * r] * 2, dim=1)
    got_equal = hvd.alltoall(equal)
    want_equal = torch.cat([torch.stack([torch.arange(2 * r, 2 * r + 2, dtype=torch.float64) + 100 * s] * 2, dim=1)
                            for s in range(n)])
    splits, rows = rows_for(r, n)
    output, received = hvd.alltoall(rows, splits=splits)
    want, want_splits = [], []
    for s in range(n):
        s_splits, s_rows = rows_for(s, n)
        start = sum(s_splits[:r])
        want.append(s_rows[start:start + s_splits[r]])
        want_splits.append(s_splits[r])
    ok = close(got_equal, want_equal) and close(output, torch.cat(want)) and received.tolist() == want_splits
    return ok, [received.tolist(), want_splits]


@check
def reducescatter_average_and_sum():
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1
    x = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * (r + 1)
    total = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * sum(k + 1 for k in range(n))
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    averaged = hvd.reducescatter(x)
    summed = hvd.reducescatter(x, op=hvd.Sum, postscale_factor=2.0)
    ok = close(averaged, total[start:start + counts[r]] / n) and close(summed, total[start:start + counts[r]] * 2)
    return ok, counts


@check
def objects_and_barrier():
    r, n = hvd.rank(), hvd.size()
    hvd.barrier()
    obj = hvd.broadcast_object({"from": r, "f": lambda v: v + 1} if r == 1 else None, root_rank=1)
    gathered = hvd.allgather_object({"rank": r, "data": list(range(r))})
    ok = obj["from"] == 1 and obj["f"](1) == 2 and gathered == [{"rank": k, "data": list(range(k))} for k in range(n)]
    return ok, gathered


@check
def autograd_through_collectives():
    r, n = hvd.rank(), hvd.size()
    failures = []
    # allreduce: the gradient is the same reduction of the output's gradient.
    for op, reduce in ((hvd.Sum, lambda t: t.sum(0)), (hvd.Average, lambda t: t.mean(0))):
        x = mine(r).requires_grad_()
        weights = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) * (k + 1) for k in range(n)]
        (hvd.allreduce(x, op=op, postscale_factor=0.5) * weights[r]).sum().backward()
        if not close(x.grad, reduce(torch.stack(weights)) * 0.5):
            failures.append(f"allreduce op {op}: {x.grad.tolist()}")
    # allgather: a rank's rows get their part of the averaged gradient.
    x = torch.zeros(r + 1, 2, dtype=torch.float64, requires_grad=True)
    total_rows = sum(k + 1 for k in range(n))
    scale = [torch.arange(total_rows * 2, dtype=torch.float64).reshape(total_rows, 2) * (k + 1) for k in range(n)]
    (hvd.allgather(x) * scale[r]).sum().backward()
    start = sum(k + 1 for k in range(r))
    if not close(x.grad, torch.stack(scale).mean(0)[start:start + r + 1]):
        failures.append(f"allgather: {x.grad.tolist()}")
    # broadcast: the root gets the averaged gradient, the others zeros.
    x = mine(r).requires_grad_()
    (hvd.broadcast(x, 0) * (r + 1)).sum().backward()
    want = torch.full((3,), (n + 1) / 2, dtype=torch.float64) if r == 0 else torch.zeros(3, dtype=torch.float64)
    if not close(x.grad, want):
        failures.append(f"broadcast: {x.grad.tolist()}")
    # alltoall: each row's gradient comes back from the rank it went to.
    splits, rows = rows_for(r, n)
    x = rows.clone().requires_grad_()
    output, _ = hvd.alltoall(x, splits=splits)
    (output * (r + 1)).sum().backward()
    want = torch.cat([torch.full((splits[d], 2), float(d + 1), dtype=torch.float64) for d in range(n)])
    if not close(x.grad, want):
        failures.append(f"alltoall: {x.grad.tolist()}")
    return not failures, failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = time.monotonic()
    hvd.init()
    init_seconds = time.monotonic() - started
    checks = {**CHECKS, **hvd_optimizer_checks.CHECKS}
    results = {}
    for name, func in checks.items():
        started = time.monotonic()
        try:
            ok, detail = func()
            results[name] = {"ok": bool(ok), "detail": repr(detail)[:2000]}
        except Exception:
            results[name] = {"ok": False, "detail": traceback.format_exc()[-2000:]}
        results[name]["seconds"] = round(time.monotonic() - started, 3)
        hvd.barrier()  # a failed check must not shift the next one's collectives
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": hvd.rank(), "size": hvd.size(), "init_seconds": round(init_seconds, 3), "checks": results}
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
