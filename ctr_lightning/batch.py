"""The typed container every DataModule yields and every model consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    """One mini-batch of ad-log examples.

    Args:
        dense: ``[B, num_dense]`` float32 continuous features.
        sparse: categorical features as a KeyedJaggedTensor, one key per feature.
        labels: ``[B]`` float32 click labels in {0, 1}.
        groups: ``[B]`` int64 grouping column (user or query id) when the data has one: GAUC
            is computed per group.
        records: ``[B]`` int64 place of each example among its split's records, for predict
            output (set when reading ``predict_paths``).
        event_time: ``[B]`` int64 POSIX seconds of each example, when the DataModule reads
            them (an ``event_time_column``, or ``partition_time=True``): what an
            ``Expiry(ttl="7d")`` counts in.

    Example::

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["C1"], values=torch.tensor([7, 9]), lengths=torch.tensor([1, 1]))
        batch = Batch(dense=torch.zeros(2, 13), sparse=kjt, labels=torch.tensor([0.0, 1.0]))
        batch = batch.to("cpu")
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    groups: torch.Tensor | None = None
    records: torch.Tensor | None = None
    event_time: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        # Lightning's transfer_batch_to_device calls this, so the KJT moves as one unit.
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            groups=None if self.groups is None else self.groups.to(device, non_blocking=non_blocking),
            records=self.records,  # row numbers stay on the host, where predictions are written
            event_time=self.event_time,  # read on the host, by the tables' expiry
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)
        if self.groups is not None:
            self.groups.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
            groups=None if self.groups is None else self.groups.pin_memory(),
            records=self.records,
            event_time=self.event_time,
        )
