import json

import pytest
import torch


# A plain LightningModule with no embeddings: the strategy must plug into any codebase.
RANK_SCRIPT = r"""
import json, os, sys
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from ctr_lightning.strategies import KStepAdamStrategy

rank, config, out_dir = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
world_size = int(os.environ.get("WORLD_SIZE", "1"))  # read once: Lightning's teardown of a fit deletes it

class MLP(pl.LightningModule):
    def __init__(self, optimizer):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.optimizer = optimizer
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, amsgrad=self.optimizer == "amsgrad")

class TwoOptimizers(MLP):
    # Manual optimization with one Adam per layer: every batch takes two optimizer steps.
    def __init__(self):
        super().__init__("adam")
        self.automatic_optimization = False
    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
    def configure_optimizers(self):
        return [torch.optim.Adam(self.net[0].parameters(), lr=0.01),
                torch.optim.Adam(self.net[2].parameters(), lr=0.01)]

class StepData(MLP):
    # Each step's batch is a function of (step, rank), so a resumed run sees the batches
    # an uninterrupted one would (a plain DataLoader restarts its epoch on resume).
    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.trainer.global_step + self.global_rank)
        x = torch.randn(16, 8, generator=g)
        return F.mse_loss(self.net(x).squeeze(-1), x.sum(1))

history, stepped, moments, stepped_moments, validated, started = [], [], [], [], [], []

def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()

def flat_moments(trainer):
    state = trainer.optimizers[0].state
    return torch.cat([torch.zeros(0)] + [state[p][name].reshape(-1) for p in trainer.lightning_module.parameters()
                                         for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                                         if name in state.get(p, {})])

class Record(pl.Callback):
    def on_train_start(self, trainer, module):
        # Right after each optimizer step, before the strategy merges or corrects.
        def after_step(*args):
            stepped.append(flat(module))
            stepped_moments.append(flat_moments(trainer))
        trainer.optimizers[0].register_step_post_hook(after_step)
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        started.append((flat(module), flat_moments(trainer)))
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        history.append(flat(module))
        moments.append(flat_moments(trainer))
    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not trainer.sanity_checking:  # after the strategy's on_validation_start
            validated.append((trainer.global_step, flat(module), flat_moments(trainer)))

def run(config):
    for recorded in (history, stepped, moments, stepped_moments, validated, started):
        recorded.clear()
    pl.seed_everything(rank)  # different starting points: the strategy must make them equal
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, x.sum(1) + 0.1 * torch.randn(512, generator=g))
    kind = config.pop("strategy")
    optimizer = config.pop("optimizer", "adam")
    val_check_interval = config.pop("val_check_interval", None)
    checkpoint_every = config.pop("checkpoint_every", None)
    resume = config.pop("resume", None)
    tag = config.pop("tag", kind)
    run_dir = os.path.join(out_dir, config.pop("dir", ""))  # where this run's files go
    os.makedirs(run_dir, exist_ok=True)
    callbacks = [Record()]
    if checkpoint_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(run_dir, "ckpt"), filename="{step}",
                                                      every_n_train_steps=checkpoint_every, save_top_k=-1))
    strategy = "ddp" if kind == "ddp" else KStepAdamStrategy(**config)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy,
                         max_steps=12, logger=False, enable_checkpointing=bool(checkpoint_every),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         val_check_interval=val_check_interval,
                         limit_val_batches=2 if val_check_interval else 0)
    module = {"two_adam": TwoOptimizers, "step_data": lambda: StepData("adam")}.get(optimizer, lambda: MLP(optimizer))()
    trainer.fit(module, DataLoader(data, batch_size=16),
                DataLoader(data, batch_size=16) if val_check_interval else None,
                ckpt_path=os.path.join(run_dir, "ckpt", resume) if resume else None)
    opt = trainer.optimizers[0]
    state = [opt.state[p] for p in trainer.lightning_module.parameters()]
    torch.save({"history": history, "stepped": stepped, "moments": moments, "stepped_moments": stepped_moments,
                "validated": validated, "started": started, "final": flat(trainer.lightning_module),
                "exp_avg": [s.get("exp_avg") for s in state]},
               os.path.join(run_dir, f"{tag}_{rank}.pt"))
    result = {"rank": rank}
    if kind != "ddp":
        result.update(merges=strategy.merges, divergence=strategy.last_divergence,
                      intra=strategy.average.bytes.intra_node, inter=strategy.average.bytes.inter_node)
    return result

# One run, or several in turn in this process (each a fresh module, strategy and Trainer).
results = [run(c) for c in (config if isinstance(config, list) else [config])]
print("RESULT " + json.dumps(results if isinstance(config, list) else results[0]), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""


def _run(run_ranks, tmp_path, world, **config):
    return run_ranks(RANK_SCRIPT, [json.dumps(config), str(tmp_path)], world=world)


def _run_in_turn(run_ranks, tmp_path, world, *configs):
    """Several runs, one after another in the same ``world`` processes."""
    return run_ranks(RANK_SCRIPT, [json.dumps(list(configs)), str(tmp_path)], world=world)


def _history(tmp_path, kind, rank):
    return torch.load(tmp_path / f"{kind}_{rank}.pt", weights_only=False)


# Every 2-rank run the tests below check, by the directory it writes to (its histories as
# "<tag>_<rank>.pt", its checkpoints under "ckpt"). They run one after another in one launch
# of 2 processes, each a fresh module, strategy and Trainer (as test_resume_continues_the_kstep_schedule's
# runs always did), so the tests share the processes' start-up instead of paying for it once each.
K4 = dict(strategy="kstep", k=4, mode="all")
RESUMED = dict(K4, optimizer="step_data", checkpoint_every=2, moment_dtype="float32", dir="resume")
TWO_RANK_RUNS = [
    dict(strategy="ddp", dir="ddp"),
    dict(strategy="kstep", k=1, mode="all", dir="k1"),
    dict(K4, warmup_steps=2, dir="k4_warmup"),
    dict(K4, optimizer="two_adam", dir="two_adam"),
    dict(K4, val_check_interval=6, moment_dtype="float32", dir="validated"),
    dict(K4, checkpoint_every=6, moment_dtype="float32", dir="checkpointed"),
    dict(K4, moment_dtype="bfloat16", bucket_bytes=25 << 20, dir="moments_bfloat16"),
    dict(K4, moment_dtype="float32", bucket_bytes=64, dir="moments_float32"),
    dict(K4, overlap=True, dir="overlap"),
    dict(K4, dir="plain"),
    dict(K4, optimizer="amsgrad", moment_dtype="float32", dir="amsgrad"),
    # The uninterrupted run, then runs resumed from its checkpoints at a merge step and
    # between merges, with only the checkpoint to go on.
    dict(RESUMED, tag="full"),
    dict(RESUMED, tag="from8", resume="step=8.ckpt"),
    dict(RESUMED, tag="from6", resume="step=6.ckpt"),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, run_ranks_in_fixture):
    """The directory of :data:`TWO_RANK_RUNS`' files, and the results of each run (by its
    directory; the resumed ones aside) by rank."""
    out = tmp_path_factory.mktemp("kstep_two_ranks")
    per_rank = run_ranks_in_fixture(RANK_SCRIPT, [json.dumps(TWO_RANK_RUNS), str(out)], world=2)
    return out, {run["dir"]: [r[i] for r in per_rank] for i, run in enumerate(TWO_RANK_RUNS) if "tag" not in run}


@pytest.mark.slow
def test_k1_all_equals_lightning_ddp(two_ranks):
    out, _ = two_ranks
    ddp, kstep = _history(out / "ddp", "ddp", 0), _history(out / "k1", "kstep", 0)
    assert len(ddp["history"]) == len(kstep["history"]) == 12
    for a, b in zip(ddp["history"], kstep["history"]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)  # after every one of the 12 steps
    for a, b in zip(ddp["exp_avg"], kstep["exp_avg"]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_k4_ranks_diverge_between_merges_and_agree_after(two_ranks):
    out, results = two_ranks[0] / "k4_warmup", two_ranks[1]["k4_warmup"]
    a, b = (_history(out, "kstep", r) for r in range(2))
    # Warm-up steps 1-2 are synchronous; then merges after steps 6 and 10 (2 + 4k).
    for step in range(12):
        same = torch.equal(a["history"][step], b["history"][step])
        assert same == (step in (0, 1, 5, 9)), step
    # Steps 11-12 ran locally; fit ends by merging them, so it returns one model.
    assert not torch.equal(a["history"][11], b["history"][11])
    torch.testing.assert_close(a["final"], (a["stepped"][11] + b["stepped"][11]) / 2, atol=1e-7, rtol=0)
    assert torch.equal(a["final"], b["final"])
    for x, y in zip(a["exp_avg"], b["exp_avg"]):
        assert torch.equal(x, y)
    assert [r["merges"] for r in results] == [3, 3] and results[0]["divergence"] > 0
    assert results[0]["inter"] == 0  # one node: everything stays inside it


@pytest.mark.slow
def test_amsgrad_maxima_are_merged_with_the_moments(two_ranks):
    # Adam(amsgrad=True) divides by the running maximum of exp_avg_sq: a merge averages it with
    # the moments, so the ranks leave every merge (after steps 4, 8, 12) with one state.
    out = two_ranks[0] / "amsgrad"
    a, b = (_history(out, "kstep", r) for r in range(2))
    per_moment = len(a["history"][0])  # exp_avg, exp_avg_sq, max_exp_avg_sq: a model's size each
    assert a["moments"][0].numel() == 3 * per_moment
    for step in range(12):
        merged = step in (3, 7, 11)
        assert torch.equal(a["moments"][step], b["moments"][step]) == merged, step
        if merged:
            torch.testing.assert_close(a["moments"][step], (a["stepped_moments"][step] + b["stepped_moments"][step]) / 2,
                                       atol=1e-9, rtol=1e-6)
            assert torch.equal(a["history"][step], b["history"][step])


@pytest.mark.slow
def test_every_merge_covers_every_optimizer(two_ranks):
    # 12 optimizer steps in 6 batches; merges at steps 4, 8 and 12 all fall on the second
    # optimizer's step, and must still average the first optimizer's layer too.
    out, results = two_ranks[0] / "two_adam", two_ranks[1]["two_adam"]
    a, b = (_history(out, "kstep", r) for r in range(2))
    assert len(a["history"]) == 6
    for batch in range(6):
        assert torch.equal(a["history"][batch], b["history"][batch]) == (batch in (1, 3, 5)), batch
    assert [r["merges"] for r in results] == [3, 3]


@pytest.mark.slow
def test_validation_sees_the_merged_model_and_the_schedule_goes_on(two_ranks):
    out, results = two_ranks[0] / "validated", two_ranks[1]["validated"]
    a, b = (_history(out, "kstep", r) for r in range(2))
    # Merges after steps 4 and 8 (every k) and 12, and when validation starts after step 6.
    assert [v[0] for v in a["validated"]] == [6, 12]
    step6, model, moments = a["validated"][0]
    assert not torch.equal(a["history"][5], b["history"][5])  # steps 5-6 ran locally
    torch.testing.assert_close(model, (a["stepped"][5] + b["stepped"][5]) / 2, atol=1e-7, rtol=0)
    torch.testing.assert_close(moments, (a["stepped_moments"][5] + b["stepped_moments"][5]) / 2, atol=1e-9, rtol=1e-7)
    assert torch.equal(model, b["validated"][0][1]) and torch.equal(moments, b["validated"][0][2])
    # Training goes on from the merged model, locally, until the merge after step 8.
    assert not torch.equal(a["history"][6], b["history"][6])
    assert torch.equal(a["history"][7], b["history"][7])
    assert torch.equal(a["validated"][1][1], b["validated"][1][1])  # step 12 merged on schedule
    assert [r["merges"] for r in results] == [4, 4]


@pytest.mark.slow
def test_a_checkpoint_between_merges_holds_the_merged_model_and_training_goes_on(two_ranks):
    out, results = two_ranks[0] / "checkpointed", two_ranks[1]["checkpointed"]
    a, b = (_history(out, "kstep", r) for r in range(2))

    def saved(step):
        ckpt = torch.load(out / "ckpt" / f"step={step}.ckpt", weights_only=False)
        model = torch.cat([v.reshape(-1) for v in ckpt["state_dict"].values()])
        adam = ckpt["optimizer_states"][0]["state"]
        return model, torch.cat([adam[i][name].reshape(-1) for i in sorted(adam) for name in ("exp_avg", "exp_avg_sq")])

    # Step 6 lies between the merges after steps 4 and 8: the checkpoint holds the ranks' mean ...
    model, moments = saved(6)
    assert not torch.equal(a["stepped"][5], b["stepped"][5])
    torch.testing.assert_close(model, (a["stepped"][5] + b["stepped"][5]) / 2, atol=1e-7, rtol=0)
    torch.testing.assert_close(moments, (a["stepped_moments"][5] + b["stepped_moments"][5]) / 2, atol=1e-9, rtol=1e-7)
    # ... while each rank trains on from its own model and moments, as without the checkpoint.
    for rank in (a, b):
        assert torch.equal(rank["started"][6][0], rank["stepped"][5])
        assert torch.equal(rank["started"][6][1], rank["stepped_moments"][5])
    assert [r["merges"] for r in results] == [3, 3]  # after steps 4, 8 and 12: no extra merge
    # Step 12 merged on schedule: the checkpoint is that model.
    model, moments = saved(12)
    assert torch.equal(model, a["history"][11]) and torch.equal(model, b["history"][11])
    assert torch.equal(moments, a["moments"][11])


@pytest.mark.slow
@pytest.mark.parametrize("moment_dtype, bucket_bytes", [("bfloat16", 25 << 20), ("float32", 64)])
def test_merges_average_parameters_exactly_and_moments_in_moment_dtype(two_ranks, moment_dtype, bucket_bytes):
    # 64-byte buckets split each merge into dozens of buckets (and the 33-float layer across
    # them): the averages must be the same as in one bucket.
    (run,) = [r for r in TWO_RANK_RUNS if r == dict(K4, moment_dtype=moment_dtype, bucket_bytes=bucket_bytes,
                                                      dir=r["dir"])]
    a, b = (_history(two_ranks[0] / run["dir"], "kstep", r) for r in range(2))
    for step in (3, 7, 11):  # merges after steps 4, 8 and 12
        torch.testing.assert_close(a["history"][step], (a["stepped"][step] + b["stepped"][step]) / 2,
                                   atol=1e-7, rtol=0)
        assert torch.equal(a["moments"][step], b["moments"][step])
        mean = (a["stepped_moments"][step] + b["stepped_moments"][step]) / 2
        if moment_dtype == "float32":
            torch.testing.assert_close(a["moments"][step], mean, atol=1e-9, rtol=1e-7)
        else:  # summed and divided in bfloat16: within its rounding, and not the float32 mean
            want = ((a["stepped_moments"][step].bfloat16() + b["stepped_moments"][step].bfloat16()) / 2).float()
            assert torch.equal(a["moments"][step], want)
            scale = (a["stepped_moments"][step].abs() + b["stepped_moments"][step].abs()) / 2  # exp_avg may cancel
            assert ((a["moments"][step] - mean).abs() <= 2 ** -7 * scale).all()
            assert not torch.equal(a["moments"][step], mean)


@pytest.mark.slow
def test_overlapped_merges_correct_each_rank_by_the_average_of_a_snapshot(two_ranks):
    out, results = two_ranks[0], two_ranks[1]["overlap"]
    runs = [_history(out / "overlap", "kstep", r) for r in range(2)]
    # Merges start after steps 4, 8 and 12 (snapshots of the models then) and are applied
    # after steps 8 and 12 and at the end of fit: x += mean(snapshot) - own snapshot.
    for start, applied in ((3, 7), (7, 11)):
        mean = (runs[0]["history"][start] + runs[1]["history"][start]) / 2
        for run in runs:
            want = run["stepped"][applied] + (mean - run["history"][start])
            torch.testing.assert_close(run["history"][applied], want, atol=1e-6, rtol=0)
    for step in range(12):  # between, ranks keep their own steps: never equal
        assert not torch.equal(runs[0]["history"][step], runs[1]["history"][step]), step
        if step not in (7, 11):
            assert torch.equal(runs[0]["history"][step], runs[0]["stepped"][step])  # no correction
    # The last snapshot was taken after the last step, so its correction makes the ranks equal.
    final = (runs[0]["history"][11] + runs[1]["history"][11]) / 2
    for run in runs:
        torch.testing.assert_close(run["final"], final, atol=1e-6, rtol=0)
    assert [r["merges"] for r in results] == [3, 3] and results[0]["divergence"] > 0
    # The same run without overlap merges the models themselves after steps 4 and 8.
    plain = [_history(out / "plain", "kstep", r) for r in range(2)]
    assert torch.equal(plain[0]["history"][3], plain[1]["history"][3])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_resume_continues_the_kstep_schedule(tmp_path, request, world):
    # Checkpoints every 2 steps; k=4 merges after steps 4, 8 and 12. The uninterrupted run,
    # then the resumed ones, in turn in the same processes: each a fresh module, strategy
    # and Trainer with only the checkpoint to go on, which lies before the step the run
    # before it ended at (on 2 ranks: RESUMED's runs in TWO_RANK_RUNS).
    if world == 2:
        out = request.getfixturevalue("two_ranks")[0] / RESUMED["dir"]
    else:
        _run_in_turn(request.getfixturevalue("run_ranks"), tmp_path, world, dict(RESUMED, tag="full"),
                     dict(RESUMED, tag="from8", resume="step=8.ckpt"))
        out = tmp_path / RESUMED["dir"]
    full = [_history(out, "full", r) for r in range(world)]
    assert all(len(run["history"]) == 12 for run in full)
    # From step 8, a merge step: every rank holds the merged model, and so does the
    # checkpoint; the resumed run ends where the uninterrupted one does, bit for bit.
    for rank in range(world):
        resumed = _history(out, "from8", rank)
        assert len(resumed["history"]) == 4  # steps 9-12
        assert torch.equal(resumed["final"], full[rank]["final"])
        for a, b in zip(resumed["exp_avg"], full[rank]["exp_avg"]):
            assert torch.equal(a, b)
    if world == 1:
        return
    # From step 6, between merges: the checkpoint holds the ranks' mean, every rank starts
    # from it, steps 7-8 run locally and the merge after step 8 keeps its place.
    a, b = (_history(out, "from6", r) for r in range(2))
    assert len(a["history"]) == len(b["history"]) == 6  # steps 7-12
    mean = (full[0]["stepped"][5] + full[1]["stepped"][5]) / 2
    for run in (a, b):
        torch.testing.assert_close(run["started"][0][0], mean, atol=1e-7, rtol=0)
    assert torch.equal(a["started"][0][0], b["started"][0][0])
    assert not torch.equal(a["history"][0], b["history"][0])  # step 7: local
    assert torch.equal(a["history"][1], b["history"][1])  # step 8: merged
    assert not torch.equal(a["history"][2], b["history"][2])  # step 9: local again
    assert torch.equal(a["final"], b["final"])


@pytest.mark.slow
def test_node_mode_on_two_simulated_nodes(tmp_path, run_ranks):
    results = _run(run_ranks, tmp_path, 4, strategy="kstep", k=4, mode="node", local_world_size=2)
    h = [_history(tmp_path, "kstep", r)["history"] for r in range(4)]
    for step in range(12):
        assert torch.equal(h[0][step], h[1][step]) and torch.equal(h[2][step], h[3][step])  # a node moves as one
        assert torch.equal(h[0][step], h[2][step]) == (step in (3, 7, 11)), step  # nodes meet at merges
    # Both nodes' ranks talked, inside the node and across. How many bytes: the counter is
    # the code's own ring formula, so asserting it here would test the formula against itself;
    # bytes on a real link are a benchmark's to measure.
    assert results[0]["inter"] > 0 and results[0]["intra"] > 0


SETUP_SCRIPT = r"""
import json, sys
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from ctr_lightning.strategies import KStepAdamStrategy

class Tiny(pl.LightningModule):
    def __init__(self, optimizer):
        super().__init__()
        self.layer, self.optimizer = torch.nn.Linear(2, 1), optimizer
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        kind = torch.optim.SGD if self.optimizer == "sgd" else torch.optim.Adam
        return kind(self.parameters(), lr=0.1)

outcomes = []
for strategy, optimizer in json.loads(sys.argv[2]):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=KStepAdamStrategy(**strategy), max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    try:
        trainer.fit(Tiny(optimizer), DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4))
        outcomes.append("ok")
    except ValueError as e:
        outcomes.append(str(e))
print("RESULT " + json.dumps(outcomes), flush=True)
"""


@pytest.mark.slow
def test_bad_setups_are_clear_errors(run_ranks):
    cases = [({"k": 4, "mode": "node"}, "adam"), ({"k": 4}, "sgd"), ({"k": 4, "merge_optimizer_state": False}, "sgd")]
    (outcomes,) = run_ranks(SETUP_SCRIPT, [json.dumps(cases)], world=1)
    one_node, sgd, fine = outcomes
    assert "mode='node' merges across nodes, but the 1 ranks form one node" in one_node
    assert "merge_optimizer_state=True merges Adam's exp_avg" in sgd and "SGD" in sgd
    assert fine == "ok"
