"""KStepAdamStrategy with parameters that get no gradient on some ranks.

Real 2-rank gloo runs of a model whose batches pick one of two towers: the strategy must
average every parameter in one fixed order, as Lightning's DDP with
``find_unused_parameters=True`` does, and its merges must leave the ranks' parameters
and Adam states identical.
"""

import json

import pytest
import torch

# Each rank's branch at each of the 8 steps ("ab": rank 0 takes tower a, rank 1 tower b).
# Steps 1-4 (the first k=4 window): rank 0 never uses b, so only rank 1's Adam holds its
# moments at the first merge; step 3 uses b nowhere (DDP leaves its gradient None); steps
# 5-8 step b on both ranks, but a different number of times.
PLAN = ["ab", "ab", "aa", "ab", "bb", "ba", "aa", "bb"]

RANK_SCRIPT = r"""
import json, os, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from ctr_lightning.strategies import KStepAdamStrategy

rank, plan, runs, out_dir = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
shapes = None  # each run's: whether tower b is shaped as tower a

class Branchy(BoringModel):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32) if shapes == "same" else nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 32))
        self.taken = []
    def forward(self, x):
        tower = self.a if float(x.mean()) > 0 else self.b
        self.taken.append("a" if tower is self.a else "b")
        return self.layer(tower(x))
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)
    def train_dataloader(self):
        # This rank's batches, in order (no distributed sampler): each sample leans to the
        # side that sends its batch down the planned tower.
        g = torch.Generator().manual_seed(rank)
        side = torch.tensor([1.0 if step[rank] == "a" else -1.0 for step in plan for _ in range(2)])
        return DataLoader(TensorDataset(0.5 * torch.randn(len(side), 32, generator=g) + side[:, None]), batch_size=2)

def state_of(optimizer, module):
    # Per parameter, in module order: (step, exp_avg, exp_avg_sq) copies, or None where Adam holds none.
    return [tuple(optimizer.state[p][n].detach().clone() for n in ("step", "exp_avg", "exp_avg_sq"))
            if p in optimizer.state else None for p in module.parameters()]

class Record(pl.Callback):
    def __init__(self):
        self.params, self.states = [], []
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.params.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone())
        self.states.append(state_of(trainer.optimizers[0], module))

for run in runs:
    tag, shapes, config = run.pop("tag"), run.pop("shapes"), run
    run_dir = os.path.join(out_dir, shapes)
    os.makedirs(run_dir, exist_ok=True)
    checkpoint_every = config.pop("checkpoint_every", None)
    pl.seed_everything(rank)  # different starting points: the strategy must make them equal
    record = Record()
    callbacks = [record]
    if checkpoint_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(run_dir, tag), filename="{step}",
                                                      every_n_train_steps=checkpoint_every, save_top_k=-1))
    strategy = (DDPStrategy(find_unused_parameters=True) if config.pop("strategy", "kstep") == "ddp"
                else KStepAdamStrategy(**config))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=bool(checkpoint_every), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, limit_val_batches=0,
                         use_distributed_sampler=False)
    module = Branchy()
    trainer.fit(module)
    torch.save({"params": record.params, "states": record.states, "taken": module.taken,
                "final": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
                "final_state": state_of(trainer.optimizers[0], module)},
               os.path.join(run_dir, f"{tag}_{rank}.pt"))
print("RESULT " + json.dumps({"rank": rank}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""


# The runs the tests below check, for each shape of tower b: one after another in one launch
# of 2 processes (each a fresh module, strategy and Trainer), which the tests share.
RUNS = [{"tag": "ddp", "strategy": "ddp"}, {"tag": "k1", "k": 1},
        {"tag": "k4", "k": 4, "moment_dtype": "float32", "checkpoint_every": 2},
        {"tag": "overlap", "k": 4, "overlap": True}]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, run_ranks_in_fixture):
    """Every run's directory (its checkpoints by tag) and records by rank, by shapes and tag."""
    out = tmp_path_factory.mktemp("unused_parameters")
    runs = [dict(run, shapes=shapes) for shapes in ("same", "different") for run in RUNS]
    run_ranks_in_fixture(RANK_SCRIPT, [json.dumps(PLAN), json.dumps(runs), str(out)], world=2, timeout=240)
    return {shapes: (out / shapes, {run["tag"]: [torch.load(out / shapes / f"{run['tag']}_{r}.pt", weights_only=False)
                                               for r in range(2)] for run in RUNS})
            for shapes in ("same", "different")}


def _assert_states_equal(x, y, exact=True):
    assert [s is None for s in x] == [s is None for s in y]
    for a, b in zip(x, y):
        for u, v in zip(a or (), b or ()):
            if exact:
                assert torch.equal(u, v)
            else:
                torch.testing.assert_close(u, v, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("shapes", ["same", "different"])
def test_k1_equals_ddp_with_find_unused_parameters(fitted, shapes):
    _, runs = fitted[shapes]
    ddp, k1 = runs["ddp"], runs["k1"]
    for rank in range(2):  # the plan ran as written: towers used on one rank, on both, on none
        assert ddp[rank]["taken"] == k1[rank]["taken"] == [step[rank] for step in PLAN]
    assert len(k1[0]["params"]) == len(PLAN)
    for step in range(len(PLAN)):
        assert torch.equal(k1[0]["params"][step], k1[1]["params"][step]), step  # the ranks never part
        torch.testing.assert_close(k1[0]["params"][step], ddp[0]["params"][step], atol=1e-6, rtol=0)
        # Adam holds state exactly where DDP's gradients made it: b's none until step 1, a's from step 1.
        _assert_states_equal(k1[0]["states"][step], ddp[0]["states"][step], exact=False)
        _assert_states_equal(k1[0]["states"][step], k1[1]["states"][step])


@pytest.mark.slow
@pytest.mark.parametrize("shapes", ["same", "different"])
def test_merges_leave_ranks_identical_when_towers_differ(fitted, shapes):
    out, runs = fitted[shapes]
    a, b = runs["k4"]
    assert a["taken"] == [step[0] for step in PLAN] and b["taken"] == [step[1] for step in PLAN]
    b_params = [s is None for s in a["states"][2]].count(True)
    assert b_params > 0  # rank 0 has not stepped tower b after step 3 ...
    assert all(s is not None for s in b["states"][2])  # ... rank 1 has
    for step in (3, 7):  # merges after steps 4 and 8: one model, one Adam state, step counts included
        assert torch.equal(a["params"][step], b["params"][step]), step
        _assert_states_equal(a["states"][step], b["states"][step])
        assert all(s is not None for s in a["states"][step])
    assert not torch.equal(a["params"][4], b["params"][4])  # local steps between merges

    # A checkpoint between merges (after step 2) holds the ranks' mean moments, zeros where a
    # rank held none, and the larger step count; saving it gave rank 0 no state of its own.
    saved = torch.load(out / "k4" / "step=2.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert sorted(saved) == list(range(len(a["states"][1])))
    for index, (mine, theirs) in enumerate(zip(a["states"][1], b["states"][1])):
        zeros = tuple(torch.zeros_like(t) for t in mine or theirs)
        mine, theirs = mine or zeros, theirs or zeros
        assert float(saved[index]["step"]) == max(float(mine[0]), float(theirs[0]))
        for slot, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
            torch.testing.assert_close(saved[index][name], (mine[slot] + theirs[slot]) / 2, atol=1e-9, rtol=1e-7)

    # Overlapped merges: the last correction leaves one model and one Adam state.
    a, b = runs["overlap"]
    torch.testing.assert_close(a["final"], b["final"], atol=1e-6, rtol=0)
    _assert_states_equal(a["final_state"], b["final_state"], exact=False)
    assert all(s is not None for s in a["final_state"])
