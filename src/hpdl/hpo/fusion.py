"""Horizontal fusion: K trials of one model shape trained as one fused model in one process.

The idea is HFTA's (Wang et al., "Horizontally Fused Training Array", MLSys 2021): trials that differ only in
hyper-parameters run the same operators on tensors of the same shapes, so their K small kernels can be one
kernel on K-times larger tensors; a GPU that one small trial leaves idle (kernel launches bound it) then
trains K of them for about the launch cost of one. HFTA rewrites the model with fused operators; here the
parameters of the K models are stacked along a new leading dimension (``torch.func.stack_module_state``)
and the unchanged model runs under ``torch.func.vmap`` of ``torch.func.functional_call``, which turns a
convolution into a grouped convolution and a linear layer into a batched matmul, so any workload whose
model is vmappable can opt in (``Workload.fuse_vary``, see docs/hpo.md "Fusing trials").

Each trial keeps what a trial run alone has:

- its own optimizer hyper-parameters: :class:`FusedOptimizer` runs the update of ``torch.optim.SGD``,
  ``Adam`` or ``AdamW`` on the stacked parameters with per-trial tensors of shape (K, 1, ...) for the learning
  rate, weight decay, momentum or betas and epsilon, taken from the K optimizers the workload built;
- its own schedule (``Workload.lr_scale``: warm-up, cosine) and its own seeds: each trial's model is built
  after ``torch.manual_seed(seed)`` as alone, and its batches come from its own ``batch(step)`` (trials whose
  ``Workload.data_key`` is equal share one batch, which vmap then broadcasts without a copy);
- its own reports, pruning and checkpoints, in the format of a trial run alone (a fused trial can continue
  alone and the other way round);
- a pruned, finished or failed trial leaves the fused model (its rows are dropped) and the others go on.

The losses of the K trials are summed before the backward pass; the trials share no parameter, so each
gradient is that of its own loss, as alone. Same seed and data order give the loss curve of the trial run
alone within float32 rounding (tests/hpo/test_fusion.py checks 1e-5 relative on CPU).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

from hpdl.hpo.checkpoint import CheckpointMismatch
from hpdl.hpo.errors import HpoConfigError


class FusedModel:
    """K models of one architecture as stacked parameters: each parameter and buffer becomes one tensor of
    shape (K, *shape), row k being model k's.

    Args:
        models: K >= 1 modules with equal parameter and buffer names and shapes (tied parameters allowed).
    Raises:
        HpoConfigError: the models differ in a name or shape (they cannot be fused).
    """

    def __init__(self, models: Sequence[nn.Module]):
        if not models:
            raise HpoConfigError("FusedModel: models is empty, expected at least one module")
        ref = models[0]
        sig = _signature(ref)
        for i, m in enumerate(models[1:], 1):
            if _signature(m) != sig:
                raise HpoConfigError(f"FusedModel: model {i} differs from model 0 in a parameter or buffer name or "
                                     "shape; only trials of one model shape can be fused")
        self.params, self.buffers = stack_module_state(list(models))  # leaves (K, ...), requires_grad
        self.param_ids = {id(p): n for n, p in ref.named_parameters()}  # model 0's tensors -> names
        # tied parameters (GPT's head and embedding) appear once in named_parameters(); the meta copy below
        # loses the tie, so every alias is passed explicitly
        first: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        for name, t in ref.named_parameters(remove_duplicate=False):
            canon = first.setdefault(id(t), name)
            if canon != name:
                self.aliases[name] = canon
        self.state_keys = list(ref.state_dict().keys())
        self.base = copy.deepcopy(ref).to("meta")  # structure only: its tensors are replaced at every call
        self.training = True

    @property
    def size(self) -> int:
        return next(iter(self.params.values())).shape[0]

    def _call(self, p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        full = dict(p)
        for alias, canon in self.aliases.items():
            full[alias] = p[canon]
        return functional_call(self.base, (full, b), (x,))

    def train(self, mode: bool = True) -> None:
        self.training = mode
        self.base.train(mode)

    def losses(self, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool) -> torch.Tensor:
        """Per-trial losses (K,) of inputs ``x`` and targets ``y``: (K, ...) each, or one batch for all trials
        (``shared``: broadcast by vmap, no copy)."""
        dims = None if shared else 0
        return vmap(lambda p, b, xx, yy: loss_fn(self._call(p, b, xx), yy),
                    in_dims=(0, 0, dims, dims), randomness="different")(self.params, self.buffers, x, y)

    def metric(self, metric_fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool,
               chunk: int | None = None) -> torch.Tensor:
        """Per-trial metric (K,) in eval mode without gradients; ``chunk`` trials at a time (bounds memory)."""
        dims = None if shared else 0
        was = self.training
        self.train(False)
        try:
            with torch.no_grad():
                return vmap(lambda p, b, xx, yy: metric_fn(self._call(p, b, xx), yy), in_dims=(0, 0, dims, dims),
                            chunk_size=chunk)(self.params, self.buffers, x, y)
        finally:
            self.train(was)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only trials ``rows`` (in that order); the others' parameters and buffers are dropped."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=next(iter(self.params.values())).device)
        self.params = {n: p.detach().index_select(0, idx).requires_grad_(True) for n, p in self.params.items()}
        self.buffers = {n: b.index_select(0, idx) for n, b in self.buffers.items()}

    def state_dict(self, k: int) -> dict[str, torch.Tensor]:
        """Trial ``k``'s ``model.state_dict()`` as the model alone would give it (copies)."""
        out = {}
        for key in self.state_keys:
            src = self.params.get(self.aliases.get(key, key))
            src = self.buffers[key] if src is None else src
            out[key] = src[k].detach().clone()
        return out

    def load_state_dict(self, k: int, state: dict[str, torch.Tensor]) -> None:
        """Set trial ``k``'s row from a ``model.state_dict()`` of the model alone.

        Raises:
            HpoConfigError: a key is missing or a shape differs.
        """
        missing = [key for key in self.state_keys if key not in state]
        if missing:
            raise HpoConfigError(f"FusedModel.load_state_dict: missing keys {missing[:5]}")
        with torch.no_grad():
            for name, p in self.params.items():
                p[k].copy_(state[name])
            for name, b in self.buffers.items():
                b[k].copy_(state[name])


def _is_batched(t: torch.Tensor) -> bool:
    """True when ``t`` is a tensor of a ``torch.func.vmap`` level (its trial dimension is hidden)."""
    check = getattr(torch._C._functorch, "is_batchedtensor", None)  # torch 2.0-2.14; absent: assume batched
    return True if check is None else bool(check(t))


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                 is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` (no mask, no dropout) that also trains under the
    ``vmap`` of a fused model. Use it in a workload's model in place of the torch function (the ``gpt``
    workload does); alone it is the torch function itself.

    Why: inside ``vmap`` the batched query does not report ``requires_grad`` (the gradient is recorded on the
    stacked tensors underneath), so SDPA's memory-efficient CUDA kernel, the one float32 takes, is asked not to
    compute the log-sum-exp (``should_compute_logsumexp`` in ATen); its backward then gets an empty one and
    fails with ``LSE is not correctly aligned (strideH)``. Under ``vmap`` this function therefore folds the
    trial dimension into the batch dimension and calls SDPA once on the stacked tensors themselves,
    (K, B, H, T, D) -> (K * B, H, T, D), a view with each sample's strides unchanged (so each trial's attention
    is the kernel call its trial alone makes, on K times the batch), which require grad: the kernel keeps the
    log-sum-exp and autograd records its own backward. On CPU the same fold replaces vmap's fallback, a loop of
    K SDPA calls.

    Args:
        query, key, value: (..., L, E), (..., S, E), (..., S, Ev) as for the torch function, float.
        is_causal, scale: as for the torch function.
    Returns:
        (..., L, Ev), the dtype of ``query``.
    """
    if _is_batched(query) or _is_batched(key) or _is_batched(value):
        return _FoldedAttention.apply(query, key, value, is_causal, scale)
    return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)


class _FoldedAttention(torch.autograd.Function):
    """SDPA whose ``vmap`` rule folds the vmapped dimension into the batch dimension (see
    :func:`scaled_dot_product_attention`). Outside ``vmap`` (never reached from that function when torch says
    which tensors are batched) it is SDPA with a backward that recomputes the forward."""

    generate_vmap_rule = False

    @staticmethod
    def forward(query, key, value, is_causal, scale):
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, ctx.is_causal, ctx.scale = inputs
        ctx.save_for_backward(query, key, value)

    @staticmethod
    def backward(ctx, grad):
        leaves = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(*leaves, is_causal=ctx.is_causal, scale=ctx.scale)
        return (*torch.autograd.grad(out, leaves, grad), None, None)

    @staticmethod
    def vmap(info, in_dims, query, key, value, is_causal, scale):
        k = info.batch_size
        q, kk, v = (t.expand(k, *t.shape) if d is None else t.movedim(d, 0)  # (K, *logical shape)
                    for t, d in zip((query, key, value), in_dims[:3]))
        # SDPA broadcasts the batch dimensions of query, key and value (a key of (H, S, E) beside a query of
        # (B, H, L, E)): give all three the common batch shape first, so that K folds into the same dimension
        batch = torch.broadcast_shapes(q.shape[1:-2], kk.shape[1:-2], v.shape[1:-2])

        def fold(t: torch.Tensor) -> torch.Tensor:
            t = t[(slice(None),) + (None,) * (len(batch) + 3 - t.dim())]   # batch dims aligned from the right
            t = t.expand(k, *batch, *t.shape[-2:])   # no-op when the shapes already agree
            # (K, B, ...) -> (K * B, ...): a view when B's stride times B is K's (vmap's stacked layout)
            return t.reshape(k * batch[0], *t.shape[2:]) if batch else t

        out = scaled_dot_product_attention(fold(q), fold(kk), fold(v), is_causal=is_causal,
                                           scale=scale)  # an outer vmap: again
        return (out.reshape(k, -1, *out.shape[1:]) if batch else out), 0


def _signature(m: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return ([(n, tuple(p.shape)) for n, p in m.named_parameters(remove_duplicate=False)]
            + [(n, tuple(b.shape)) for n, b in m.named_buffers()])


class FusedOptimizer:
    """The update of K ``torch.optim`` optimizers (``SGD``, ``Adam`` or ``AdamW``, one parameter group each)
    on a :class:`FusedModel`'s stacked parameters, with every hyper-parameter per trial.

    The arithmetic is that of ``torch.optim``'s single-tensor and for-each paths (same operations in the same
    order, ``addcmul`` where torch multiplies by a scalar inside an add, so that the rounding is the same),
    with a trial's scalar replaced by its entry of a (K, 1, ...) tensor; bias corrections are computed per
    trial in float64 on the host, as torch does.

    Args:
        optimizers: the K optimizers the workload built for the K trials (only their type, hyper-parameters
            and parameter order are read; their state must be empty).
        model: the fused model of the same K trials.
    Raises:
        HpoConfigError: another optimizer type, more than one parameter group, different types, ``nesterov``
            that differs between trials, or options the fused update does not implement
            (``amsgrad``, ``maximize``, SGD ``dampening``).
    """

    KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], model: FusedModel):
        kinds = {self.KINDS.get(type(o)) for o in optimizers}
        if None in kinds or len(kinds) != 1:
            raise HpoConfigError(f"fusion: optimizers {sorted({type(o).__name__ for o in optimizers})}; expected one "
                                 "type of torch.optim.SGD, Adam or AdamW for all trials of a fused model")
        self.kind = kinds.pop()
        groups = []
        for o in optimizers:
            if len(o.param_groups) != 1:
                raise HpoConfigError("fusion: an optimizer has several parameter groups, expected one")
            g = o.param_groups[0]
            if g.get("maximize") or g.get("amsgrad"):
                raise HpoConfigError("fusion: maximize and amsgrad are not implemented by the fused optimizer")
            groups.append({k: v for k, v in g.items() if k != "params"})
        self.groups = groups
        self.model = model
        ref = optimizers[0].param_groups[0]["params"]  # model 0's tensors, in the optimizer's order
        if len(ref) != len(model.params) or any(id(p) not in model.param_ids for p in ref):
            raise HpoConfigError(f"fusion: the optimizer holds {len(ref)} tensors, the model {len(model.params)} "
                                 "parameters; each parameter of the model must be optimized once")
        self.order = [model.param_ids[id(p)] for p in ref]  # state dict index i -> parameter name
        dev = next(iter(model.params.values())).device
        self.device = dev
        if self.kind == "sgd":
            if len({g["nesterov"] for g in groups}) > 1:
                raise HpoConfigError("fusion: SGD nesterov differs between trials, expected one value")
            if any(g["dampening"] for g in groups):
                raise HpoConfigError("fusion: SGD dampening is not implemented by the fused optimizer, expected 0")
            self.nesterov = bool(groups[0]["nesterov"])
        else:
            self.decoupled = self.kind == "adamw" or bool(groups[0].get("decoupled_weight_decay", False))
        self.steps = [0] * len(groups)  # optimizer steps taken per trial
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in model.params.items():
            if self.kind == "sgd":
                self.state[n] = {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
            else:
                self.state[n] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _col(self, values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float32)
        if self.device.type == "cuda":  # pinned: the copy is queued behind the step, the host does not wait
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    @staticmethod
    def _b(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *([1] * (like.dim() - 1)))

    def zero_grad(self) -> None:
        for p in self.model.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, lrs: Sequence[float]) -> None:
        """One update of every trial with learning rates ``lrs`` (K floats, the schedule's values now)."""
        g = self.groups
        K = len(g)
        if len(lrs) != K:
            raise HpoConfigError(f"FusedOptimizer.step: {len(lrs)} learning rates for {K} trials")
        self.steps = [s + 1 for s in self.steps]
        if self.kind == "sgd":
            rows = [list(lrs), [x["weight_decay"] for x in g], [x["momentum"] for x in g]]
            lr, wd, mom = self._col([v for r in rows for v in r]).view(3, K).unbind(0)
            any_wd, any_mom = any(x["weight_decay"] for x in g), any(x["momentum"] for x in g)
            for n in self.order:
                p = self.model.params[n]
                grad = p.grad
                if any_wd:  # torch: grad.add(param, alpha=weight_decay); addcmul rounds as that does (one FMA)
                    grad = torch.addcmul(grad, self._b(wd, p), p)
                if any_mom:
                    buf = self.state[n]["momentum_buffer"]
                    # first step: torch starts the buffer at grad; 0 * momentum + grad is exactly that
                    buf.mul_(self._b(mom, p)).add_(grad)
                    grad = torch.addcmul(grad, self._b(mom, p), buf) if self.nesterov else buf
                p.addcmul_(self._b(-lr, p), grad)  # torch: param.add_(grad, alpha=-lr)
            return
        b1 = [x["betas"][0] for x in g]
        b2 = [x["betas"][1] for x in g]
        bc1 = [1 - b ** s for b, s in zip(b1, self.steps)]
        bc2 = [1 - b ** s for b, s in zip(b2, self.steps)]
        rows = [[1 - lr * x["weight_decay"] for lr, x in zip(lrs, g)], [x["weight_decay"] for x in g],
                [1 - b for b in b1], b2, [1 - b for b in b2], [-(lr / c) for lr, c in zip(lrs, bc1)],
                [c ** 0.5 for c in bc2], [x["eps"] for x in g]]
        decay, wd, w1, beta2, w2, step_size, bc2_sqrt, eps = self._col([v for r in rows for v in r]).view(
            len(rows), K).unbind(0)
        any_wd = any(x["weight_decay"] for x in g)
        for n in self.order:
            p = self.model.params[n]
            grad = p.grad
            st = self.state[n]
            if any_wd:
                if self.decoupled:
                    p.mul_(self._b(decay, p))
                else:
                    grad = torch.addcmul(grad, self._b(wd, p), p)
            st["exp_avg"].lerp_(grad, self._b(w1, p))
            # torch: addcmul_(grad, grad, value=1 - beta2), i.e. ((1 - beta2) * grad) * grad + exp_avg_sq
            st["exp_avg_sq"].mul_(self._b(beta2, p)).addcmul_(self._b(w2, p) * grad, grad)
            denom = (st["exp_avg_sq"].sqrt() / self._b(bc2_sqrt, p)).add_(self._b(eps, p))
            p.addcmul_(st["exp_avg"] / denom, self._b(step_size, p))  # torch: addcdiv_(exp_avg, denom, value=-step)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only trials ``rows`` (call after :meth:`FusedModel.keep` with the same rows)."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.state = {n: {k: v.index_select(0, idx) for k, v in st.items()} for n, st in self.state.items()}
        self.groups = [self.groups[r] for r in rows]
        self.steps = [self.steps[r] for r in rows]

    def state_dict(self, k: int, lr: float | None = None) -> dict:
        """Trial ``k``'s ``optimizer.state_dict()`` as its optimizer alone would give it (copies); ``lr``: the
        group's current learning rate (default: its base)."""
        group = dict(self.groups[k])
        group["initial_lr"] = self.base_lr(k)  # the schedule's base (the solo loop's param_groups carry it too)
        if lr is not None:
            group["lr"] = lr
        group["params"] = list(range(len(self.order)))
        state: dict[int, dict] = {}
        if self.steps[k] > 0:
            for i, n in enumerate(self.order):
                st = self.state[n]
                if self.kind == "sgd":
                    if group["momentum"] != 0:
                        state[i] = {"momentum_buffer": st["momentum_buffer"][k].clone()}
                else:
                    state[i] = {"step": torch.tensor(float(self.steps[k])), "exp_avg": st["exp_avg"][k].clone(),
                                "exp_avg_sq": st["exp_avg_sq"][k].clone()}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, k: int, sd: dict) -> None:
        """Set trial ``k`` from an ``optimizer.state_dict()`` of its optimizer alone (a checkpoint).

        Raises:
            HpoConfigError: not one parameter group, or another number of parameters.
        """
        if len(sd.get("param_groups", ())) != 1 or len(sd["param_groups"][0]["params"]) != len(self.order):
            raise HpoConfigError("FusedOptimizer.load_state_dict: expected one group over every parameter")
        group = {key: v for key, v in sd["param_groups"][0].items() if key != "params"}
        self.groups[k] = {**self.groups[k], **group}
        ids = sd["param_groups"][0]["params"]
        steps = 0
        with torch.no_grad():
            for i, n in zip(ids, self.order):
                st = sd["state"].get(i)
                if not st:
                    continue
                for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                    if st.get(key) is not None:
                        self.state[n][key][k].copy_(st[key])
                if "step" in st:
                    steps = int(float(st["step"]))
                elif st.get("momentum_buffer") is not None:
                    steps = max(steps, 1)
        self.steps[k] = steps

    def base_lr(self, k: int) -> float:
        g = self.groups[k]
        return float(g.get("initial_lr", g["lr"]))


# ------------------------------------------------------------------------------------------ the fused loop
@dataclass
class _Member:
    ctx: Any
    p: dict
    parts: Any
    start: int = 0
    value: float = float("nan")
    left: bool = False


def train_fused(workload, ctxs: Sequence[Any], device: torch.device, on_outcome: Callable[..., None],
                step_ctx: Callable[[int], Any] | None = None, state_sink: Callable[[Callable], None] | None = None,
                on_sync: Callable[[], None] | None = None) -> None:
    """Train the trials of ``ctxs`` as one fused model to their last step.

    Args:
        workload: a :class:`hpdl.hpo.workloads.Workload` with ``fuse_vary`` whose ``build`` gives ``val`` and
            ``metric``.
        ctxs: one trial context per trial (``params``, ``report``, ``should_prune``, ``load_checkpoint``,
            ``save_checkpoint``, ``checkpoint_every``; optional ``losses`` list: each step's training loss is
            appended, a 0-d tensor), all with one ``workload.fusion_key``.
        device: where the fused model trains.
        on_outcome: called once per trial when it leaves: ``on_outcome(ctx, "done", value)``,
            ``(ctx, "pruned", message)`` or ``(ctx, "failed", (kind, message))``.
        step_ctx: ``step_ctx(i)`` wraps fused step ``i`` (a context manager: profiling, preemption); None: none.
        state_sink: given a function ``save_all(i)`` that checkpoints every trial still training at fused step
            ``i`` (what a preemption calls).
        on_sync: called after each evaluation (it synchronised the device; a profiler drops that interval).
    Raises:
        HpoConfigError: the trials do not share a fusion key, or the workload is not fusable.
        Any error of the fused step itself (every trial still training then failed with it; the caller reports).
    """
    if not workload.fuse_vary:
        raise HpoConfigError(f"workload {workload.name!r} is not fusable: it lists no fuse_vary parameters")
    ps = [workload.resolve(c.params) for c in ctxs]
    keys = {workload.fusion_key(p) for p in ps}
    if len(keys) != 1:
        raise HpoConfigError(f"fusion: {len(keys)} different fusion keys in one group, expected one: "
                             f"{sorted(keys)[:2]}")
    members = []
    for c, p in zip(ctxs, ps):
        torch.manual_seed(int(p.get("seed", 0)))  # each trial's initialisation as alone
        parts = workload.build(p, device)
        if parts.val is None or parts.metric is None:
            raise HpoConfigError(f"workload {workload.name!r}: build() gives no val/metric, which fusion needs")
        members.append(_Member(c, p, parts))
    model = FusedModel([m.parts.model for m in members])
    opt = FusedOptimizer([m.parts.optimizer for m in members], model)
    for m in members:  # the lone model, its optimizer and evaluate() (which holds the model) are not used again
        m.parts.model = m.parts.optimizer = m.parts.evaluate = None
    steps, every = workload.schedule(ps[0])
    data_keys = [workload.data_key(p) for p in ps]
    live = list(range(len(members)))  # live[r]: the member in row r of the fused tensors

    def leave(rows: list[int]) -> None:
        keep = [r for r in range(len(live)) if r not in rows]
        for r in rows:
            members[live[r]].left = True
        if keep:
            model.keep(keep)
            opt.keep(keep)
        live[:] = [live[r] for r in keep]

    # checkpoints: each trial continues from its own, or fails alone when it is someone else's
    failed = []
    for r, i in enumerate(live):
        m = members[i]
        try:
            state = m.ctx.load_checkpoint()
        except Exception as exc:  # noqa: BLE001 - someone else's checkpoint, or a file that cannot be read
            kind = "checkpoint" if isinstance(exc, CheckpointMismatch) else "error"
            on_outcome(m.ctx, "failed", (kind, str(exc)))
            failed.append(r)
            continue
        if state is not None:
            model.load_state_dict(r, state["model"])
            opt.load_state_dict(r, state["optimizer"])
            m.start, m.value = int(state["step"]), float(state["value"])
    if failed:
        leave(failed)
    done_rows = [r for r, i in enumerate(live) if members[i].start >= steps]
    for r in done_rows:  # already finished in its checkpoint: the value stands
        on_outcome(members[live[r]].ctx, "done", members[live[r]].value)
    if done_rows:
        leave(done_rows)

    def member_state(r: int, step: int) -> dict:
        m = members[live[r]]
        lr = opt.base_lr(r) * workload.lr_scale(m.p, step)
        return {"model": model.state_dict(r), "optimizer": opt.state_dict(r, lr), "step": step, "value": m.value}

    def save_all(i: int) -> None:
        for r, idx in enumerate(live):
            m = members[idx]
            if m.ctx.checkpoint_every:
                m.ctx.save_checkpoint(member_state(r, m.start + i))

    if state_sink is not None:
        state_sink(save_all)
    model.train(True)
    # each trial's reports, pruning decisions and checkpoints run in these threads (storage and file I/O)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(live))), thread_name_prefix="hpdl-fused-io") as io:
        chunk = None
        i = 0
        while live:
            wrap = step_ctx(i) if step_ctx is not None else contextlib.nullcontext()
            with wrap:
                rows_steps = [members[idx].start + i for idx in live]
                x, y, shared = _batches([members[idx] for idx in live], [data_keys[idx] for idx in live],
                                        rows_steps)
                losses = model.losses(members[live[0]].parts.loss, x, y, shared)
                opt.zero_grad()
                losses.sum().backward()
                opt.step([opt.base_lr(r) * workload.lr_scale(members[idx].p, s)
                          for r, (idx, s) in enumerate(zip(live, rows_steps))])
            for r, idx in enumerate(live):
                rec = getattr(members[idx].ctx, "losses", None)
                if rec is not None:
                    rec.append(losses[r].detach())
            evals = [r for r, s in enumerate(rows_steps) if (s + 1) % every == 0 or s + 1 == steps]
            if evals:
                if chunk is None:  # evaluate no more samples at once than a training step holds
                    bsz = int(x.shape[1] if not shared else x.shape[0])
                    vsz = max(1, int(members[live[0]].parts.val[0].shape[0]))
                    chunk = max(1, (len(live) * bsz) // vsz)
                values = _evaluate(model, [members[idx] for idx in live], [data_keys[idx] for idx in live], evals,
                                   chunk)
                if on_sync is not None:
                    on_sync()
                jobs = []
                for r, v in zip(evals, values):
                    m = members[live[r]]
                    done = rows_steps[r] + 1
                    m.value = v
                    # taken now (training goes on in place), written only if the pruner lets the trial go on
                    keep = m.ctx.checkpoint_every and (done // every) % m.ctx.checkpoint_every == 0
                    jobs.append((r, m, v, done, member_state(r, done) if keep else None))
                # overlapped across the trials, each trial's in its own order; outcomes go out from here, in order
                results = list(io.map(lambda j: _report(*j[1:]), jobs))
                leaving = []
                for (r, m, v, done, _), (kind, payload) in zip(jobs, results):
                    if kind != "ok":
                        on_outcome(m.ctx, kind, payload)
                        leaving.append(r)
                    elif done >= steps:
                        on_outcome(m.ctx, "done", v)
                        leaving.append(r)
                if leaving:
                    leave(leaving)
            i += 1


def _report(m: _Member, value: float, done: int, state: dict | None) -> tuple[str, Any]:
    """Report ``value`` at step ``done`` for one trial, ask its pruner, then write ``state`` (if any) as its
    checkpoint: ``("ok", None)``, ``("pruned", message)`` or ``("failed", (kind, message))`` for a storage
    error of that trial. A checkpoint that cannot be written raises (the run folder's fault, not the trial's)."""
    import optuna

    try:
        m.ctx.report(value, done)
        if m.ctx.should_prune():
            return "pruned", f"pruned at step {done} with value {value:.4g}"
        if state is not None:
            m.ctx.save_checkpoint(state)
    except optuna.exceptions.OptunaError as exc:
        return "failed", ("error", f"{type(exc).__name__}: {exc}")
    return "ok", None


def _batches(ms: list[_Member], keys: list, steps: list[int]):
    """Inputs (K, B, ...) and targets of the live trials at their steps; one shared batch when every trial
    has the same data key and step (``shared``)."""
    if keys[0] is not None and all(k == keys[0] for k in keys) and all(s == steps[0] for s in steps):
        x, y = ms[0].parts.batch(steps[0])
        return x, y, True
    made: dict = {}
    xs, ys = [], []
    for m, k, s in zip(ms, keys, steps):
        key = (k, s) if k is not None else (id(m), s)
        if key not in made:
            made[key] = m.parts.batch(s)
        xs.append(made[key][0])
        ys.append(made[key][1])
    return torch.stack(xs), torch.stack(ys), False


def _evaluate(model: FusedModel, ms: list[_Member], keys: list, rows: list[int], chunk: int) -> list[float]:
    """Metric of the trials in ``rows`` (one host synchronisation)."""
    if keys[0] is not None and all(k == keys[0] for k in keys):
        vx, vy = ms[0].parts.val
        vals = model.metric(ms[0].parts.metric, vx, vy, True, chunk)
    else:
        vx = torch.stack([m.parts.val[0] for m in ms])
        vy = torch.stack([m.parts.val[1] for m in ms])
        vals = model.metric(ms[0].parts.metric, vx, vy, False, chunk)
    out = vals.float().tolist()
    return [float(out[r]) for r in rows]


# ------------------------------------------------------------------------------------- worker side
def run_group(env, conn, task, parent_pid: int | None) -> bool:
    """Worker body for a fused group (``task.fused``: one :class:`hpdl.hpo.messages.Task` per trial; ``task``
    itself carries the group's profiling request and memory cap). Sends one outcome per trial as it leaves
    (``Done``, ``Pruned``, ``Failed``; ``Halted`` for every trial still training when the driver preempts or
    stops the group), each after a ``PeakMemory`` of the group. Returns False when the process should exit
    (the fused step failed: CUDA state may be unusable)."""
    import optuna

    from hpdl.hpo import messages
    from hpdl.hpo.checkpoint import CheckpointWriteError
    from hpdl.hpo.errors import Preempted
    from hpdl.hpo.profiler import StepProfiler, TrialProfile
    from hpdl.hpo.trial import TrialContext, cap_memory

    dev = env.dev
    ctxs, open_ids = [], []
    sent: set[int] = set()

    def peak() -> None:
        if dev.type == "cuda":
            conn.send(messages.PeakMemory(trial_id=task.trial_id, kind=env.device["kind"],
                                          bytes=int(torch.cuda.max_memory_reserved(dev)) + int(task.context_bytes)))

    def outcome(ctx, kind: str, payload) -> None:
        tid = ctx._task.trial_id
        if tid in sent:
            return
        sent.add(tid)
        peak()
        if kind == "done":
            conn.send(messages.Done(trial_id=tid, value=float(payload)))
        elif kind == "pruned":
            conn.send(messages.Pruned(trial_id=tid))
        else:
            conn.send(messages.Failed(trial_id=tid, kind=payload[0], message=str(payload[1])[-2000:]))

    try:
        for m in task.fused:
            trial = optuna.trial.Trial(env.study, m.trial_id)
            for key, val in (("hpdl_host", m.host), ("hpdl_pid", os.getpid()), ("hpdl_started_at", time.time()),
                             ("hpdl_device", m.device_id), ("hpdl_fused", len(task.fused))):
                trial.set_user_attr(key, val)
            params = env.workload.resolve({**env.spec.get("fixed", {}), **m.params})
            ctxs.append(TrialContext(trial, params, dev, None, m, env.run_dir,
                                     int(env.spec.get("checkpoint_every", 1)), None, None))
            open_ids.append(m.trial_id)
        prof = None
        if task.profile:
            prof = StepProfiler(dev, env.device["kind"], TrialProfile(**task.static),
                                peak_flops=env.device.get("peak_flops") or 5e10, context_bytes=int(task.context_bytes))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            cap_memory(dev, task.memory_cap, int(task.context_bytes))
        group = _GroupStep(conn, task, dev, prof, parent_pid)
        train_fused(env.workload, ctxs, dev, outcome, group.step, group.sink, group.interrupt)
    except Preempted as exc:
        for ctx in ctxs:
            if ctx._task.trial_id not in sent:
                sent.add(ctx._task.trial_id)
                conn.send(messages.Halted(trial_id=ctx._task.trial_id))
        return not exc.stop
    except CheckpointWriteError as exc:
        _fail_rest(conn, ctxs, sent, task, "checkpoint_write", str(exc))
        return False
    except torch.cuda.OutOfMemoryError as exc:
        _fail_rest(conn, ctxs, sent, task, "oom", str(exc).splitlines()[0][:300])
        return False
    except Exception as exc:  # noqa: BLE001 - the fused step failed: every trial still in it fails
        oom = any(s in str(exc) for s in ("out of memory", "ALLOC_FAILED"))
        _fail_rest(conn, ctxs, sent, task, "oom" if oom else "error", traceback.format_exc()[-2000:])
        return False
    finally:
        if dev.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    return True


def _fail_rest(conn, ctxs, sent: set, task, kind: str, message: str) -> None:
    from hpdl.hpo import messages

    for m in task.fused:  # contexts not yet made count too
        if m.trial_id not in sent:
            sent.add(m.trial_id)
            conn.send(messages.Failed(trial_id=m.trial_id, kind=kind, message=message))


class _GroupStep:
    """What :meth:`hpdl.hpo.trial.TrialContext.step` does for one trial, for a fused group: the parent
    check, preemption (every trial still training checkpoints, then :class:`Preempted`) and the in-place
    profile of the group's first steps, reported for the group (``task.trial_id``)."""

    def __init__(self, conn, task, device, profiler, parent_pid):
        self.conn, self.task, self.device, self.profiler, self.parent = conn, task, device, profiler, parent_pid
        self.save_all: Callable[[int], None] | None = None

    def sink(self, save_all: Callable[[int], None]) -> None:
        self.save_all = save_all

    def interrupt(self) -> None:
        if self.profiler is not None:
            self.profiler.interrupt()  # an evaluation synchronised the device between two steps

    @contextlib.contextmanager
    def step(self, i: int):
        from hpdl.hpo import messages
        from hpdl.hpo.errors import Preempted
        from hpdl.hpo.trial import cap_memory

        if self.parent is not None and os.getppid() != self.parent:
            os._exit(3)  # the driver died: never leave trials running
        if self.conn is not None and self.conn.poll():
            msg = messages.check(self.conn.recv())
            if isinstance(msg, (messages.Preempt, messages.Stop)):
                if self.save_all is not None:
                    self.save_all(i)
                raise Preempted(f"fused group of trial {self.task.number} preempted at step {i}",
                                stop=isinstance(msg, messages.Stop))
        if self.profiler is not None:
            self.profiler.before(i)
        yield
        if self.profiler is not None:
            self.profiler.after(i)
            if self.profiler.done:
                from dataclasses import asdict

                res = self.profiler.result
                self.conn.send(messages.ProfileReport(trial_id=self.task.trial_id, profile=asdict(res)))
                if self.task.memory_cap and self.device.type == "cuda":
                    cap_memory(self.device, min(int(self.task.memory_cap), res.memory_bytes),
                               int(self.task.context_bytes))
                self.profiler = None


def fused_memory(single_bytes: int, k: int, context_bytes: int) -> int:
    """Memory bound (bytes) of ``k`` fused trials from one trial's bound: the CUDA context once, everything
    else (weights, optimizer state, activations) ``k`` times."""
    return int(context_bytes + k * max(0, single_bytes - context_bytes))


__all__ = ["FusedModel", "FusedOptimizer", "scaled_dot_product_attention", "train_fused", "run_group",
           "fused_memory"]
