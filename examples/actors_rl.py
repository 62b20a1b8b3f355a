"""Actors beside a trainer on the mesh: a contextual-bandit environment and a replay buffer per rank feed a
data-parallel Q-learner (dask_monarch issue 17; Monarch's actors with the tensor engine).

Each rank of the mesh holds an ``Env`` actor and a ``ReplayBuffer`` actor (Dask actors on that rank's worker,
``mesh.spawn``). Every step, with tensors passed both ways and never through the controller:

1. ``env.observe.rref(batch)``: the environment's contexts stay on the mesh as a remote tensor;
2. the trainer picks arms epsilon-greedily from its Q-network (``nn.Linear``, parameters on the mesh);
3. ``env.step.rref(obs, actions)``: the actor gets each rank's local actions and returns the rewards;
4. ``buffer.add.broadcast(obs, actions, rewards)`` stores them, ``buffer.sample.rref(batch)`` draws a batch;
5. a regression step on the sample, gradients averaged over ``dp`` (``reduce_``), SGD.

Every actor call runs on its rank's stream in order with the tensor operations around it, so the buffer samples
what the steps before it added. The environment is the same bandit on every rank (arm weights from a shared
seed); contexts, exploration and sampling differ per rank (seeded from the worker's mesh). The last line is
``mean_reward=R optimal=O random=Q``: the greedy policy's mean reward over the last evaluation, against always
picking the best arm and picking at random.

    python examples/actors_rl.py                  # embedded cluster, 2 workers
    python examples/actors_rl.py --scheduler tcp://host:8786 --workers 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import dask_monarch as dm


class Env:
    """A contextual bandit: context ``x`` (``dim`` floats), arm ``k`` pays ``x @ w[k]`` plus noise."""

    def __init__(self, dim: int, arms: int, task_seed: int):
        self.weights = torch.randn(arms, dim, generator=torch.Generator().manual_seed(task_seed))
        self.generator = torch.Generator()

    def reset(self, mesh, seed: int) -> int:
        """Seed this rank's contexts and noise from its coordinate in the mesh (the worker's ``DeviceMesh``)."""
        rank = mesh.dims["dp"].rank
        self.generator.manual_seed(seed + rank)
        return rank

    @dm.endpoint(propagate=lambda batch, dim: torch.empty(batch, dim))
    def observe(self, batch: int, dim: int) -> torch.Tensor:
        return torch.randn(batch, dim, generator=self.generator)

    @dm.endpoint(propagate=lambda obs, actions: torch.empty(actions.shape[0]))
    def step(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Rewards ``(batch,)`` float32 of ``actions`` ``(batch,)`` int64 in contexts ``obs`` ``(batch, dim)``."""
        mean = (obs * self.weights[actions]).sum(1)
        return mean + 0.1 * torch.randn(mean.shape, generator=self.generator)

    def score(self, obs: torch.Tensor, actions: torch.Tensor) -> dict:
        """Mean expected reward of ``actions``, of the best arms and of random arms, in contexts ``obs``."""
        payoff = obs @ self.weights.T
        return {"reward": payoff.gather(1, actions[:, None]).mean().item(), "optimal": payoff.max(1).values.mean().item(),
                "random": payoff.mean().item()}


class ReplayBuffer:
    """The last ``capacity`` transitions of this rank; ``sample`` draws a batch uniformly."""

    def __init__(self, capacity: int, dim: int):
        self.obs = torch.empty(0, dim)
        self.actions = torch.empty(0, dtype=torch.int64)
        self.rewards = torch.empty(0)
        self.capacity = capacity
        self.generator = torch.Generator()

    def add(self, obs, actions, rewards) -> None:
        self.obs = torch.cat([self.obs, obs])[-self.capacity:]
        self.actions = torch.cat([self.actions, actions])[-self.capacity:]
        self.rewards = torch.cat([self.rewards, rewards])[-self.capacity:]

    @dm.endpoint(propagate=lambda batch, dim: (torch.empty(batch, dim), torch.empty(batch, dtype=torch.int64),
                                               torch.empty(batch)))
    def sample(self, batch: int, dim: int):
        index = torch.randint(len(self.rewards), (batch,), generator=self.generator)
        return self.obs[index], self.actions[index], self.rewards[index]

    def __len__(self) -> int:
        return len(self.rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", default=None, help="Dask scheduler address (default: an embedded cluster)")
    parser.add_argument("--workers", type=int, default=2, help="mesh size: number of data-parallel ranks")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="contexts per rank per step")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--arms", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    B, D, K = args.batch, args.dim, args.arms

    with dm.attach(args.scheduler, dims={"dp": args.workers}) as mesh:
        env = mesh.spawn(Env, D, K, args.seed)
        buffer = mesh.spawn(ReplayBuffer, 4096, D)
        print("ranks:", list(env.reset.call(mesh, args.seed).result().values()))
        with mesh.activate():
            dm.remote(torch.manual_seed, propagate="inspect")(args.seed)  # the same initial Q-network everywhere
            q = torch.nn.Linear(D, K)
            optimizer = torch.optim.SGD(q.parameters(), lr=0.05, foreach=True)
            for step in range(1, args.steps + 1):
                obs = env.observe.rref(B, D)
                with torch.no_grad():
                    greedy = q(obs).argmax(1)
                    explore = torch.rand(B) < max(0.05, 1.0 - step / (0.5 * args.steps))
                    actions = torch.where(explore, torch.randint(K, (B,)), greedy)
                rewards = env.step.rref(obs, actions)
                buffer.add.broadcast(obs, actions, rewards)
                o, a, r = buffer.sample.rref(B, D)
                loss = F.mse_loss(q(o).gather(1, a[:, None]).squeeze(1), r)
                optimizer.zero_grad()
                loss.backward()
                dm.reduce_([p.grad for p in q.parameters()], "dp", "avg")
                optimizer.step()
                if step % 50 == 0 or step == args.steps:
                    test = env.observe.rref(256, D)
                    with torch.no_grad():
                        scores = list(env.score.call(test, q(test).argmax(1)).result().values())
                    mean = {k: sum(s[k] for s in scores) / len(scores) for k in scores[0]}
                    print(f"step {step}: loss {dm.inspect(loss).item():.4f}, greedy reward {mean['reward']:.3f} "
                          f"(optimal {mean['optimal']:.3f}, random {mean['random']:.3f})")
        print(f"mean_reward={mean['reward']:.3f} optimal={mean['optimal']:.3f} random={mean['random']:.3f}")


if __name__ == "__main__":
    main()
