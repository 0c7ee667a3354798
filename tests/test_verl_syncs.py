"""Host synchronisations and device work of verl's log-prob path through the longmoe engine,
against PolicyTrainer.compute_logprobs on the same samples, audited on CPU.

On an accelerator an op that reads a device tensor's values on the host (nonzero, item, a
boolean-mask index, repeat_interleave without output_size, unique, equal, a copy to the host,
.tolist()) blocks the host until the device has drained its queue. On CPU nothing blocks, so
the audit tracks which tensors would live on the trainer's device:

  - a tensor is "device" when a torch function made it with the trainer's own device object
    (`PolicyTrainer.device`, passed down as is: `.to(device)`, `torch.zeros(..., device=...)`),
    when it is a parameter or buffer of the model, or when an op made it from a device tensor;
  - a copy of a device tensor to the host (.cpu(), .to("cpu"), .tolist(), .item(), .numpy(),
    bool()/int()/float()) is a synchronisation, and its result is a fresh host tensor;
  - an op with a device input is device work, and a syncing op among them a synchronisation.

Each record carries the call site: the innermost frame in longmoe, verl or tensordict. Records
inside the model's forward (longmoe/model, longmoe/ops) are the same on both paths and left out.
The comparison of the two paths is in test_verl_engine.py (the file the verl environment's CI
step runs); this file holds the audit and its own check.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

from _verl import ragged, reference, verl_env, worker  # noqa: E402,F401
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

SYNC_OPS = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "equal", "is_nonzero", "item"}
TO_HOST = {"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}
MODEL_DIRS = ("longmoe/model/", "longmoe/ops/")
OURS = ("longmoe/", "verl/", "tensordict/")


def _site() -> str:
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if any(o in path for o in OURS) and "/torch/" not in path and __file__ not in path:
            i = max(path.rfind(o) for o in OURS if o in path)
            return f"{path[i:]}:{f.f_lineno}"
        f = f.f_back
    return "?"


class Audit:
    """Records (kind, op, call site) of the device work and host synchronisations of a region,
    with `device` the trainer's device object and `model` whose tensors start on it."""

    def __init__(self, device, model):
        self.device = device
        self.dev: dict[int, weakref.ref] = {}  # id -> the device tensor (ids are reused)
        for t in list(model.parameters()) + list(model.buffers()):
            self.add(t)
        self.records: list[tuple[str, str, str, str]] = []
        self.forwards, self._depth, self._quiet = 0, 0, 0
        self._hooks = [model.register_forward_pre_hook(self._enter, prepend=True),
                       model.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, *_):
        self.forwards += 1
        self._depth += 1

    def _leave(self, *_):
        self._depth -= 1

    def add(self, t) -> None:
        self.dev[id(t)] = weakref.ref(t)

    def on_device(self, t) -> bool:
        r = self.dev.get(id(t)) if isinstance(t, torch.Tensor) else None
        return r is not None and r() is t

    def mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)

    def note(self, kind: str, op: str) -> None:
        phase = "model" if self._depth else ("after" if self.forwards else "before")
        self.records.append((kind, op, _site(), phase))

    def outside_model(self, kind: str, phases=("before", "after")) -> Counter:
        """(op, site) -> count of the records of `kind` outside the model's forward: before
        the first forward, or after it (where a synchronisation stalls queued device work)."""
        return Counter((op, site) for k, op, site, ph in self.records
                       if k == kind and ph in phases and not site.startswith(MODEL_DIRS))

    def __enter__(self):
        self._fn, self._ops = _Boundary(self), _Ops(self)
        self._fn.__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc):
        self._ops.__exit__(*exc)
        self._fn.__exit__(*exc)
        for h in self._hooks:
            h.remove()


def _names_device(x, device) -> bool:
    return any(a is device for a in tree_flatten(x)[0])


class _Boundary(TorchFunctionMode):
    """Copies between the host and the trainer's device, seen at the torch-function level (on
    CPU the dispatcher never sees a copy to the device the tensor is already on)."""

    def __init__(self, audit):
        super().__init__()
        self.a = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a, name = self.a, getattr(func, "__name__", "")
        self_dev = bool(args) and a.on_device(args[0])
        rest = tree_flatten((args[1:], kwargs))[0]
        to_host = name in TO_HOST or (name == "to" and not _names_device(rest, a.device)
                                      and any(str(x) == "cpu" for x in rest))
        if self_dev and to_host:
            a.note("sync", f"to_host.{name}")
            a._quiet += 1  # the ops of the copy itself are this one record
            try:
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out is args[0]:
                    out = out.clone()  # what a real copy returns: a host tensor
            finally:
                a._quiet -= 1
            if isinstance(out, torch.Tensor):
                a.dev.pop(id(out), None)
            return out
        out = func(*args, **kwargs)
        if _names_device((args, kwargs), a.device):
            if name == "to" and isinstance(args[0], torch.Tensor) and not self_dev:
                nb = kwargs.get("non_blocking", False) or any(x is True for x in args[2:])
                a.note("h2d", "to(non_blocking)" if nb else "to(blocking)")
            a.mark(out)
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, audit):
        super().__init__()
        self.a = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = self.a
        inputs = tree_flatten((args, kwargs))[0]
        dev_in = any(a.on_device(t) for t in inputs)
        out = func(*args, **kwargs)
        if dev_in and not a._quiet:
            name = func.overloadpacket.__name__
            a.mark(out)
            if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
                a.add(args[0])
            a.note("device", name)
            bool_index = name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in tree_flatten(args[1:])[0])
            ri = name == "repeat_interleave" and kwargs.get("output_size") is None
            if name in SYNC_OPS or bool_index or ri:
                a.note("sync", name)
        return out


def audit_paths(env, budget, entropy=False):
    """(verl audit, direct audit) of one log-prob pass of the same six samples each way."""
    pt, path = reference("tiny", env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=6, seed=3)
    w = worker(path, "tiny", max_tokens=budget)
    trainer = w.engine.trainer
    batch = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(batch, calculate_entropy=entropy, compute_loss=False,
                         max_token_len_per_gpu=budget)
    verl_a = Audit(trainer.device, trainer.model)
    with verl_a:
        out = w.infer_batch(batch)
    direct_a = Audit(trainer.device, trainer.model)
    with direct_a:
        want = trainer.compute_logprobs(samples)
    lp = out["log_probs"]
    for i, (s, row) in enumerate(zip(samples, lp.unbind())):  # both computed log-probs
        P = s.prompt.numel()
        got = row[P - 1:P - 1 + s.response.numel()]
        assert torch.allclose(got, want[i], atol=1e-5, rtol=0), i
    return verl_a, direct_a


def table(a: Audit, kind: str) -> str:
    return "\n".join(f"  {n:4d} {op:24s} {site}" for (op, site), n in
                     sorted(a.outside_model(kind).items(), key=lambda x: -x[1]))


def counts(a: Audit) -> dict:
    """Outside the model's forward: synchronisations before the first forward and after it
    (those stall queued device work), device ops, blocking copies to the device."""
    n = lambda kind, ph=("before", "after"): sum(a.outside_model(kind, ph).values())  # noqa: E731
    return {"forwards": a.forwards, "syncs_before": n("sync", ("before",)),
            "syncs_after": n("sync", ("after",)), "device_ops": n("device"),
            "blocking_h2d": sum(1 for r in a.records if r[:2] == ("h2d", "to(blocking)"))}


def test_audit_sees_a_synchronisation(verl_env):
    """The audit itself: a copy to the host, an item and a nonzero of a tensor made on the
    trainer's device are three synchronisations; the same ops on a host tensor are none."""
    pt, _ = reference("tiny", verl_env)
    a = Audit(pt.device, pt.model)
    with a:
        x = torch.arange(4).to(pt.device)
        x.cpu(), x.sum().item(), x.nonzero()
        y = torch.arange(4)
        y.cpu(), y.sum().item(), y.nonzero()
    assert [r[1] for r in a.records if r[0] == "sync"] == ["to_host.cpu", "to_host.item",
                                                          "nonzero"]
    assert [r[1] for r in a.records if r[0] == "h2d"] == ["to(blocking)"]


