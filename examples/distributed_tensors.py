"""Distributed tensors, step by step: Monarch's tutorial ``docs/source/examples/distributed_tensors.py`` told again for
dask_monarch, on an embedded local Dask cluster of 4 CPU workers.

The cells (``# %%``, as Jupyter, VS Code and jupytext read them) follow the tutorial's 22 in order and teach the same
things: meshes and their tables, local versus mesh torch, looking at one rank's values, commands on every rank,
recovery from a failed command, collectives, reshaping meshes, pipelining across sub-meshes, data parallelism
with ``grad_generator``, and overlapping communication with compute on a second stream. Where this differs from
Monarch's (one cluster for every mesh, CPU workers, no simulator, no pictures) the cell says so. Run it::

    python examples/distributed_tensors.py

or cell by cell in a notebook. The last line printed is ``all cells ran``.
"""

# %%
# Setup
# -----
# ``dm.attach`` starts an embedded Dask cluster (one worker process per rank) and a session on it; give it a
# ``Client`` or a scheduler address to use a cluster you already run. Monarch's tutorial puts tensors on CUDA by
# default; these workers are CPU ones, so the tensors stay on the CPU.

import traceback

import torch
import torch.nn as nn

import dask_monarch as dm
from dask_monarch.builtins.random import set_manual_seed_remote

# %%
# Meshes
# ------
# Every computation runs on a *mesh*: named dimensions over the workers. Monarch spawns 8 GPU processes on this
# host; here 4 worker processes, seen as one dimension ``gpu``. ``to_table`` shows which worker each rank is.

hosts = dm.attach(dims={"host": 2, "gpu": 2})  # the session; its 4 ranks reshaped as needed below
mesh = hosts.flatten("gpu")
print(mesh.to_table())

# %%
# Without an active mesh, torch runs locally, in this process.

print(torch.rand(3, 4))

# %%
# Inside ``mesh.activate()``, every torch call runs on every rank of the mesh. ``t`` is a remote tensor: this process
# knows its shape and dtype; each rank holds its own values.

with mesh.activate():
    t = torch.rand(3, 4)

print(t)

# %%
# ``dm.inspect`` brings rank 0's copy of ``t`` here (on the CPU) for a look; ``dm.show`` displays it as a table
# (HTML in a notebook).

print(dm.inspect(t))
dm.show(t)

# %%
# Coordinates pick another rank's copy.

dm.show(t, gpu=1)

# %%
# Tensor commands
# ---------------
# A command given here, such as a product of these tensors, runs on every rank, on each rank's own copy.

with mesh.activate():
    obj = t @ t.T
    dm.show(obj)

# %%
# A command that fails does not take the workers down: the error comes back when a value depending on it is asked
# for, and the next commands run as before. (A tensor of 2**45 floats cannot be allocated anywhere.)

try:
    with mesh.activate():
        big_w = torch.rand(4, 1024 * 1024 * 1024 * 1024 * 8)  # too big
        v = t @ big_w
        dm.show(v)
except Exception:
    traceback.print_exc()

del big_w, v
print("RECOVERED!")

# %%
# Because failures are recoverable, you can search for what works. Here: the largest block of memory each rank's
# worker process may reserve, doubling until the operating system refuses. (Monarch's tutorial fills GPU memory;
# ``torch.empty`` only reserves it, so this search never makes a worker use the memory it asks for, which on a
# CPU machine could get the worker stopped.)

n = 1
while True:
    try:
        with mesh.activate():
            batch = torch.empty(n, 1024 * 1024 * 1024, dtype=torch.uint8)  # n GiB
            last = batch[-1, -1:].fill_(1)
        dm.inspect(last)
        n *= 2
    except Exception as e:
        print(f"{n // 2} GiB can be reserved on every rank; {n} GiB cannot ({type(e).__name__})")
        break
del batch, last

# %%
# Collectives
# -----------
# Each rank has its own copy of a tensor, as with torch.distributed. Computing across the copies takes a
# collective: ``reduce`` over a mesh dimension.

with mesh.activate():
    a = torch.rand(3, 4)
    r = a.reduce("gpu", "sum")

dm.show(a, gpu=0)
dm.show(a, gpu=1)
dm.show(r, gpu=0)  # every rank has the sum...
dm.show(r, gpu=1)  # ...the same one

# %%
# More dimensions
# ---------------
# Monarch's tutorial reserves remote GPUs of a 4x4 host x gpu mesh from a scheduler. With Dask, the workers of a
# cluster you run are attached with ``dm.attach("tcp://scheduler:8786", dims={"host": 4, "gpu": 4})``; here the
# session's own 4 workers, as 2 hosts of 2 ``gpu`` ranks, do: reductions run over either dimension.

remote_mesh = hosts
print(remote_mesh.to_table())
with remote_mesh.activate():
    eg = torch.rand(3, 4)
    rgpu = eg.reduce("gpu", "sum")
    rhost = eg.reduce("host", "sum")
dm.show(rgpu, host=1, gpu=0)

# %%
# Device mesh dimensions
# ----------------------
# Meshes are renamed and reshaped to fit the parallelism wanted.

mesh_2d_parallel = remote_mesh.rename(host="dp", gpu="tp")
print(mesh_2d_parallel.to_table())

mesh_3d_parallel = remote_mesh.split(host=("dp", "pp"), gpu=("tp",), pp=2)
print(mesh_3d_parallel.to_table())

# %%
# Pipelining
# ----------
# A pipeline slices the mesh into stages and copies tensors from one stage's mesh to the next.

pipeline_mesh = remote_mesh.rename(host="pp")
meshes = [pipeline_mesh.slice(pp=i) for i in range(pipeline_mesh.size("pp"))]

print(meshes[0].to_table())

# %%
# A model whose stages live on different meshes: each stage's layers are created on its own sub-mesh.

layers_per_stage = 2
stages = []
for stage_mesh in meshes:
    with stage_mesh.activate():
        layers = []
        for _ in range(layers_per_stage):
            layers.extend([nn.Linear(4, 4), nn.ReLU()])
        stages.append(nn.Sequential(*layers))


def forward_pipeline(x):
    with torch.no_grad():
        for stage_mesh, stage in zip(meshes, stages):
            x = x.to_mesh(stage_mesh)
            with stage_mesh.activate():
                x = stage(x)
        return x


with meshes[0].activate():
    input = torch.rand(3, 4)

output = forward_pipeline(input)
dm.show(output)
print(output.mesh.to_table())

# %%
# Data parallelism
# ----------------
# The next cells write data-parallel training (DDP) the way one develops code for a mesh. The backward pass is
# interleaved with the gradient reductions and the parameter updates: ``dm.grad_generator`` runs backward
# incrementally, giving the gradients one at a time, last layer first, so one gradient is reduced while backward
# computes the next.


def train(model, input, target):
    loss = model(input, target)
    rparameters = list(reversed(list(model.parameters())))
    grads = dm.grad_generator(loss, rparameters)
    with torch.no_grad():
        it = iter(zip(rparameters, grads))
        todo = next(it, None)
        while todo is not None:
            param, grad = todo
            grad.reduce_("dp", "sum")
            todo = next(it, None)
            param += 0.01 * grad


# %%
# Running it
# ----------
# Monarch checks this code on a simulator (``monarch.Simulator``, a mesh that simulates instead of computing) and
# draws a timeline of each rank's work. dask_monarch has no simulator: this runs the step for real, on a ``dp`` mesh
# of the 4 workers, and checks what DDP promises, that every replica ends with the same parameters. Each rank's
# work shows, as it runs, on the dashboard page ``run_ddp`` prints.


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        layers = []
        for _ in range(8):
            layers.append(nn.Linear(4, 4))
            layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, input, target):
        output = self.layers(input)
        return torch.nn.functional.cross_entropy(output, target)


def run_ddp():
    ddp_mesh = mesh.rename(gpu="dp")
    with ddp_mesh.activate():
        set_manual_seed_remote(0)  # the same initial weights on every replica
        model = Net()
        input = torch.rand(3, 4) + ddp_mesh.rank("dp")  # each replica its own batch
        train(model, input, torch.full((3,), 1, dtype=torch.int64))
        first = next(model.parameters())
        replicas = [dm.inspect(first, dp=i) for i in range(ddp_mesh.size("dp"))]
    same = all(torch.equal(replicas[0], p) for p in replicas[1:])
    print(f"DDP step done; replicas hold the same parameters: {same}; timeline: {mesh.dashboard_link}")
    assert same


run_ddp()

# %%
# Overlapping communication with compute
# --------------------------------------
# Commands on different ranks run in parallel, but on one rank they run one after another by default. Streams give
# a rank several lines of work: here a second stream for the reductions.

main = dm.get_active_stream()
comms = dm.Stream("comms")

# %%
# (Monarch's tutorial shows a picture here: the main stream computing while the comms stream reduces.)

# %%
# A tensor made on one stream is used on another by *borrowing* it. Borrows keep memory use deterministic and rule
# out the races of torch.cuda's stream API: while a tensor is borrowed mutably, its own stream may not touch it, and
# the borrow's end (``borrow.drop()``) orders the two streams again.

# %%
# The DDP step again, with the reductions on the comms stream.


def train(model, input, target):
    loss = model(input, target)
    rparameters = list(reversed(list(model.parameters())))
    grads = dm.grad_generator(loss, rparameters)
    with torch.no_grad():
        # each gradient, with its borrow on the comms stream
        it = iter((param, grad, *comms.borrow(grad, mutable=True)) for param, grad in zip(rparameters, grads))
        todo = next(it, None)
        while todo is not None:
            param, grad, comm_grad, borrow = todo
            with comms.activate():  # the reduction runs on the comms stream
                comm_grad.reduce_("dp", "sum")
            borrow.drop()
            todo = next(it, None)
            param += 0.01 * grad


run_ddp()

# %%
# That version overlaps little: ``borrow.drop()`` comes right after the reduction is issued, so the main stream
# waits for each reduction before backward computes the next gradient. (Monarch's tutorial shows the simulated
# timeline here.)

# %%
# The overlap wanted: end each borrow after the next gradient has been asked for, just before its parameter is
# updated, so the reduction of one gradient runs while backward computes the next.


def train(model, input, target):
    loss = model(input, target)
    rparameters = list(reversed(list(model.parameters())))
    grads = dm.grad_generator(loss, rparameters)
    with torch.no_grad():
        it = iter((param, grad, *comms.borrow(grad, mutable=True)) for param, grad in zip(rparameters, grads))
        todo = next(it, None)
        while todo is not None:
            param, grad, comm_grad, borrow = todo
            with comms.activate():
                comm_grad.reduce_("dp", "sum")
            todo = next(it, None)
            borrow.drop()  # as late as possible
            param += 0.01 * grad


run_ddp()
hosts.exit()
print("all cells ran")
