"""A data-parallel training step of a small transformer language model through dask_monarch against the same step
in a plain ``torch.distributed`` script, on the same GPUs, in one run (issue 4).

Both run the same three functions per step on every GPU: ``lm_grad`` (synthetic tokens, forward and backward in
bf16 autocast, the gradient of the flat fp32 parameters), an all-reduce average of the gradient, and ``lm_update_``
(SGD with momentum, in place). dask_monarch sends them as two ``CallFunction`` messages and one ``Reduce`` per step
and never waits until the final fetch; the script calls them directly with ``dist.all_reduce``.

    python bench/train_lm.py             # 8 layers, d_model 1024, 8 x 1024 tokens per GPU
    python bench/train_lm.py --quick
    python bench/train_lm.py --compiled  # the model as plain PyTorch under activate(), its step dm.compile'd
    python bench/train_lm.py --compiled --backend inductor   # the recorded step compiled by Inductor per rank

``--compiled`` (issue 11): the same language model written as an ``nn.Module`` whose parameters live on the mesh,
trained by a plain PyTorch step (bf16 autocast forward, ``loss.backward()``, ``reduce_`` avg of every gradient,
``torch.optim.SGD`` with momentum and ``foreach=True``, ``zero_grad``) wrapped in ``dm.compile``: each step is one ``CallRecording`` per
rank (plus the ``CallFunction`` that makes its synthetic tokens). Against a plain ``torch.distributed`` script
running the very same step with one ``all_reduce`` per gradient. One GPU is enough (1 rank against a 1-process
script). The losses of the 50 timed steps are compared between the two (the curves must agree within bf16
autocast's tolerance); ``--backend inductor`` (issue 27) has each rank compile the recorded step's runs of aten ops
with ``torch.compile`` (Inductor), the gradient reduces left between them.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from _torchrun import gpu_world, run_ranks
from torch.nn import functional as F
from torch import nn

_MODELS: dict = {}


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = torch.full((seq, seq), float("-inf"), device=tokens.device).triu(1)
        h = self.blocks(self.embed(tokens), mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _skeleton(cfg: tuple) -> nn.Module:
    """The model's structure on the meta device, built once per process; parameters come from the flat tensor."""
    model = _MODELS.get(cfg)
    if model is None:
        with torch.device("meta"):
            model = LM(*cfg[:4])
        _MODELS[cfg] = model
    return model


def _views(model: nn.Module, flat: torch.Tensor) -> dict:
    views, start = {}, 0
    for name, p in model.named_parameters():
        views[name] = flat[start:start + p.numel()].view(p.shape)
        start += p.numel()
    return views


def lm_init(cfg: tuple, seed: int):
    """Flat fp32 parameters (the same on every rank) and a zero momentum buffer, on this worker's GPU."""
    model = _skeleton(cfg)
    g = torch.Generator(device="cuda").manual_seed(seed)
    parts = [torch.randn(p.numel(), device="cuda", generator=g) * (0.02 if p.dim() > 1 else 0.0)
             for _, p in model.named_parameters()]
    flat = torch.cat(parts)
    return flat, torch.zeros_like(flat)


def lm_grad(flat: torch.Tensor, cfg: tuple, step: int, rank: int):
    """Gradient of the next-token loss on a synthetic batch (seeded by step and rank), and the loss."""
    vocab, _, _, _, batch, seq = cfg
    model = _skeleton(cfg)
    g = torch.Generator(device="cuda").manual_seed(1_000_003 * step + int(rank))
    tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=g)
    p = flat.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = torch.func.functional_call(model, _views(model, p), (tokens[:, :-1],))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    (grad,) = torch.autograd.grad(loss, p)
    return grad, loss.detach()


def lm_update_(flat: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    momentum.mul_(0.9).add_(grad)
    flat.sub_(momentum, alpha=lr)


def _shapes_init(cfg, seed):
    with torch.device("meta"):
        n = sum(p.numel() for p in LM(*cfg[:4]).parameters())
    return torch.empty(n, device="cuda"), torch.empty(n, device="cuda")


def _shapes_grad(flat, cfg, step, rank):
    return torch.empty_like(flat), torch.empty((), device="cuda")


# ------------------------------------------------------------------------------------------- plain script
def _raw_worker(rank: int, world: int, cfg: tuple, steps: int) -> tuple:
    flat, momentum = lm_init(cfg, 0)

    def step(i: int):
        grad, loss = lm_grad(flat, cfg, i, rank)
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        lm_update_(flat, momentum, grad, 1e-3)
        return loss

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(100 + i)
    loss = loss.item()
    elapsed = time.perf_counter() - t0
    return steps / elapsed, loss


def raw(world: int, cfg: tuple, steps: int):
    return run_ranks(_raw_worker, world, (cfg, steps), timeout=1200)


# --------------------------------------------------------------------------------------------- dask_monarch
def through_mesh(world: int, cfg: tuple, steps: int):
    import dask_monarch as dm

    with dm.attach(dims={"dp": world}, comm_timeout=600) as mesh:
        init = dm.remote(lm_init, propagate=_shapes_init)
        grad_of = dm.remote(lm_grad, propagate=_shapes_grad)
        update_ = dm.remote(lm_update_)
        with mesh.activate():
            flat, momentum = init(cfg, 0)
            rank = mesh.rank("dp")

            def step(i: int):
                grad, loss = grad_of(flat, cfg, i, rank)
                grad.reduce_("dp", "avg")
                update_(flat, momentum, grad, 1e-3)
                return loss

            for i in range(3):
                step(i)
        dm.inspect(flat[:1])
        t0 = time.perf_counter()
        with mesh.activate():
            for i in range(steps):
                loss = step(100 + i)
        loss = dm.inspect(loss).item()
        elapsed = time.perf_counter() - t0
    return steps / elapsed, loss


# ------------------------------------------------------------------------- --compiled: the model as a Module
def make_tokens(cfg: tuple, step: int, rank):
    """A synthetic batch of ``batch`` sequences of ``seq + 1`` tokens, seeded by step and rank."""
    vocab, _, _, _, batch, seq = cfg
    g = torch.Generator(device="cuda").manual_seed(1_000_003 * step + int(rank))
    return torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=g)


def _shapes_tokens(cfg, step, rank):
    return torch.empty((cfg[4], cfg[5] + 1), dtype=torch.int64, device="cuda")


def module_step(model, optimizer, reduce_grads):
    """The training step as plain PyTorch; ``reduce_grads(grads)`` averages the gradients over the ranks."""

    def step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        reduce_grads([p.grad for p in model.parameters()])
        optimizer.step()
        return loss.detach()

    return step


def _module_raw_worker(rank: int, world: int, cfg: tuple, steps: int) -> tuple:
    """Steps/s of the plain eager script, its last loss, and its loss at each timed step (the curve)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LM(*cfg[:4])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)  # torch's CUDA default

    def all_reduce(grads):
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.AVG)

    step = module_step(model, optimizer, all_reduce)
    for i in range(3):
        step(make_tokens(cfg, i, rank))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    losses = []
    for i in range(steps):
        losses.append(step(make_tokens(cfg, 100 + i, rank)))
    curve = torch.stack(losses).tolist()  # waits for the GPU
    return steps / (time.perf_counter() - t0), curve[-1], curve


def module_compiled(world: int, cfg: tuple, steps: int, cuda_graph: bool = False, backend: str | None = None):
    import dask_monarch as dm

    with dm.attach(dims={"dp": world}, comm_timeout=600) as mesh:
        tokens_of = dm.remote(make_tokens, propagate=_shapes_tokens)
        with mesh.activate():
            dm.remote(torch.manual_seed, propagate="inspect")(0)
            with torch.device("cuda"):
                model = LM(*cfg[:4])
            # foreach=True, as torch picks for plain CUDA tensors (for tensor subclasses it picks the per-parameter
            # loop): three operations a step for the whole update instead of three per parameter
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
            rank = mesh.rank("dp")
            step = dm.compile(module_step(model, optimizer, lambda grads: dm.reduce_(grads, "dp", "avg")),
                              warmup=1, cuda_graph=cuda_graph, backend=backend)
            t0 = time.perf_counter()
            # eager (warm-up), recorded, verified (Inductor compiles; with cuda_graph and no Inductor: captured),
            # replayed (with both: captured), replayed
            for i in range(5 if backend and cuda_graph else 4):
                loss = step(tokens_of(cfg, i, rank))
        dm.inspect(loss)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        losses = []
        with mesh.activate():
            for i in range(steps):
                losses.append(step(tokens_of(cfg, 100 + i, rank)))
        curve = [x.item() for x in dm.inspect(losses)]
        elapsed = time.perf_counter() - t0
    entries = [e for es in step._cache.values() for e in es if e.recording is not None]
    ops = len(entries[0].recording.describe.ops) if entries else 0
    return steps / elapsed, curve[-1], first, ops, curve


#: the loss curves of plain torch and of a compiled step agree within this (bf16 autocast: 8 bits of mantissa, and
#: Inductor's fused kernels round in another order)
BF16_RTOL = 2e-2


def compiled_main(quick: bool, cuda_graph: bool = False, backend: str | None = None, steps: int | None = None) -> None:
    world = torch.cuda.device_count()
    if world < 1:
        raise SystemExit("needs a CUDA device")
    cfg = (32000, 512, 4, 8, 8, 512) if quick else (32000, 1024, 8, 16, 8, 1024)
    steps = steps or (10 if quick else 50)
    n_params = sum(p.numel() for p in _skeleton(cfg).parameters())
    _MODELS.clear()
    base_rate, base_loss, base_curve = run_ranks(_module_raw_worker, world, (cfg, steps), timeout=1200)
    ours_rate, ours_loss, first, ops, curve = module_compiled(world, cfg, steps, cuda_graph, backend)
    print(f"\ntransformer LM as an nn.Module, compiled step, {world} x {torch.cuda.get_device_name(0)} "
          f"({n_params / 1e6:.0f}M parameters, {cfg[4]} x {cfg[5]} tokens per GPU, bf16 autocast; torch {torch.__version__})")
    print(f"{'':36}{'steps/s':>10}{'ms/step':>10}{'last loss':>11}")
    print(f"{'plain torch.distributed (Module)':36}{base_rate:>10.2f}{1e3 / base_rate:>10.1f}{base_loss:>11.4f}")
    label = "dask_monarch, dm.compile" + (" (Inductor)" if backend else "") + (" (CUDA graph)" if cuda_graph else "")
    print(f"{label:36}{ours_rate:>10.2f}{1e3 / ours_rate:>10.1f}{ours_loss:>11.4f}")
    print(f"ratio (dask_monarch / plain): {ours_rate / base_rate:.3f}   (first steps: eager, recorded, verified, "
          f"replayed: {first:.1f} s; the recording has {ops} operations a step)")
    worst = max(abs(a - b) / abs(b) for a, b in zip(curve, base_curve))
    print(f"loss curve over {steps} steps: largest relative difference to plain torch {worst:.2e} "
          f"(bf16 tolerance {BF16_RTOL:g}: {'equal' if worst <= BF16_RTOL else 'DIFFERENT'}); first "
          f"{curve[0]:.4f} / {base_curve[0]:.4f}, last {curve[-1]:.4f} / {base_curve[-1]:.4f}")
    assert math.isfinite(ours_loss)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps")
    parser.add_argument("--compiled", action="store_true", help="the model as plain PyTorch, its step compiled")
    parser.add_argument("--cuda-graph", action="store_true", help="with --compiled: replay the step as a CUDA graph")
    parser.add_argument("--backend", default=None, choices=("inductor",),
                        help="with --compiled: compile the recorded step with Inductor on each rank")
    parser.add_argument("--steps", type=int, default=None, help="with --compiled: timed steps (default 50)")
    args = parser.parse_args(argv)
    if args.compiled:
        compiled_main(args.quick, args.cuda_graph, args.backend, args.steps)
        return
    world = gpu_world()
    # vocab, d_model, layers, heads, batch per GPU, sequence length
    cfg = (32000, 512, 4, 8, 8, 512) if args.quick else (32000, 1024, 8, 16, 8, 1024)
    steps = 10 if args.quick else 30
    n_params = sum(p.numel() for p in _skeleton(cfg).parameters())
    _MODELS.clear()  # the functions travel by value with their globals: send them without the skeleton
    base_rate, base_loss = raw(world, cfg, steps)
    ours_rate, ours_loss = through_mesh(world, cfg, steps)
    print(f"\ntransformer LM data-parallel training step, {world} x {torch.cuda.get_device_name(0)} "
          f"({n_params / 1e6:.0f}M parameters, {cfg[4]} x {cfg[5]} tokens per GPU, bf16 autocast; torch {torch.__version__})")
    print(f"{'':28}{'steps/s':>10}{'ms/step':>10}{'last loss':>11}")
    print(f"{'plain torch.distributed':28}{base_rate:>10.2f}{1e3 / base_rate:>10.1f}{base_loss:>11.4f}")
    print(f"{'dask_monarch':28}{ours_rate:>10.2f}{1e3 / ours_rate:>10.1f}{ours_loss:>11.4f}")
    print(f"ratio (dask_monarch / plain): {ours_rate / base_rate:.3f}")
    assert math.isfinite(ours_loss)


if __name__ == "__main__":
    main()
