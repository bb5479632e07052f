import pytest

from ctr_lightning.strategies import KStepAdamStrategy


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        KStepAdamStrategy(k=0)
    with pytest.raises(ValueError, match="mode must be 'all' or 'node'"):
        KStepAdamStrategy(mode="ring")
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        KStepAdamStrategy(warmup_steps=-1)
    with pytest.raises(ValueError, match="local_world_size must be an int, 'nvlink' or None"):
        KStepAdamStrategy(local_world_size="islands")
    with pytest.raises(ValueError, match="moment_dtype must be one of .*float16 would flush"):
        KStepAdamStrategy(moment_dtype="float16")


@pytest.mark.parametrize("name, value, reason", [
    ("ddp_comm_hook", lambda state, bucket: None, "a DDP communication hook"),
    ("ddp_comm_state", object(), "a DDP communication hook"),
    ("ddp_comm_wrapper", lambda hook: hook, "a DDP communication hook"),
    ("model_averaging_period", 4, "DDP.s post-local-SGD model averaging: this strategy merges the models every k"),
    ("static_graph", True, "an argument of DistributedDataParallel"),
    ("gradient_as_bucket_view", True, "an argument of DistributedDataParallel"),
    ("bucket_cap_mb", 10, "an argument of DistributedDataParallel"),
    ("broadcast_buffers", False, "an argument of DistributedDataParallel"),
])
def test_ddp_wrapper_arguments_are_refused(name, value, reason):
    # DDPStrategy hands these to its DistributedDataParallel wrapper; there is none here.
    with pytest.raises(ValueError, match=f"has no DDP wrapper, so it does not take {name} \\({reason}"):
        KStepAdamStrategy(k=4, **{name: value})


def test_unknown_arguments_and_strategy_arguments():
    from datetime import timedelta

    with pytest.raises(TypeError, match="unexpected keyword arguments: merge_every"):
        KStepAdamStrategy(merge_every=4)
    strategy = KStepAdamStrategy(k=4, process_group_backend="gloo", timeout=timedelta(seconds=60),
                                 start_method="popen")
    assert strategy.process_group_backend == "gloo"
    # Unused parameters are always handled as DDP's find_unused_parameters=True does.
    for value in (True, False):
        KStepAdamStrategy(k=4, find_unused_parameters=value)
