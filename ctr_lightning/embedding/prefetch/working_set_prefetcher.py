"""Working-set prefetch: read the rows of upcoming batches from SSD while others train."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection

log = logging.getLogger(__name__)


def _sparse_features(batch: Any) -> KeyedJaggedTensor:
    return batch if isinstance(batch, KeyedJaggedTensor) else batch.sparse


class WorkingSetPrefetcher:
    """Wraps the batches of a training loop and keeps ``lookahead`` batches read ahead.

    For each batch read ahead, the training thread notes its working set (the unique
    rows per table): rows already in memory are spared from eviction until the batch
    runs, and a background thread reads the rest from the SSD tier into DRAM. When
    the batch runs, its misses are served from there instead of waiting on the SSD;
    a row written back in the meantime is re-read, never served stale.

    Call :meth:`batch_done` after each training step (the :class:`WorkingSetPrefetch`
    callback does), or pass ``release_on_next=True`` when the loop runs each batch
    before asking for the next one.

    Example::

        prefetcher = WorkingSetPrefetcher(loader, model.embeddings, lookahead=8, release_on_next=True)
        for batch in prefetcher:
            loss = model(batch).sum(); loss.backward()
        model.embeddings.tier_stats()["prefetch_hits"]
    """

    def __init__(
        self,
        batches: Iterable[Any],
        collections: TieredEmbeddingBagCollection | Sequence[TieredEmbeddingBagCollection],
        lookahead: int = 8,
        release_on_next: bool = False,
        features: Callable[[Any], KeyedJaggedTensor] = _sparse_features,
    ) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.batches = batches
        self.collections = [collections] if isinstance(collections, TieredEmbeddingBagCollection) else list(collections)
        if not self.collections:
            raise ValueError("WorkingSetPrefetcher needs at least one TieredEmbeddingBagCollection")
        self.lookahead = lookahead
        self.release_on_next = release_on_next
        self.features = features
        self._next = 0  # number of the next batch read, over all passes
        self._yielded: deque[int] = deque()  # handed out, not yet done
        self._executor: ThreadPoolExecutor | None = None
        self._enabled = True
        self.wait_us = 0  # training waited this long for reads ahead to finish
        self.startup_wait_us = 0  # the part of it spent on the first batch of each pass

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Looks like the wrapped loader to code that inspects it (Lightning, DataModules).
        if name == "batches":
            raise AttributeError(name)
        return getattr(self.batches, name)

    def _read_ahead(self, batch: Any) -> Future | None:
        number = self._next
        self._next += 1
        reads = []
        if self._enabled:
            try:
                for collection in self.collections:
                    reads += collection.register_upcoming(self.features(batch), number)
            except NotImplementedError as e:
                log.warning("working-set prefetch is off: %s", e)
                self._enabled = False
        if not reads:
            return None
        return self._executor.submit(lambda: [read() for read in reads])

    def __iter__(self) -> Iterator[Any]:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctr-prefetch")
        ahead: deque[tuple[int, Any, Future | None]] = deque()
        source = iter(self.batches)
        exhausted = False
        first = self._next
        try:
            while True:
                while not exhausted and len(ahead) <= self.lookahead:
                    batch = next(source, _END)
                    if batch is _END:
                        exhausted = True
                        break
                    ahead.append((self._next, batch, self._read_ahead(batch)))
                if not ahead:
                    return
                if self.release_on_next and self._yielded:
                    self.batch_done()
                number, batch, read = ahead.popleft()
                if read is not None:
                    # Unfinished reads are waited for: fetching on demand would read the same rows.
                    start = time.perf_counter()
                    read.result()
                    waited = int((time.perf_counter() - start) * 1e6)
                    self.wait_us += waited
                    if number == first:  # nothing could be read ahead of the first batch
                        self.startup_wait_us += waited
                self._yielded.append(number)
                yield batch
        finally:
            self.close()

    def batch_done(self) -> None:
        """The oldest batch handed out has finished its training step."""
        if self._yielded:
            number = self._yielded.popleft()
            for collection in self.collections:
                collection.release_upcoming(number)

    def close(self) -> None:
        """Stop the background thread and return the collections to fetching on demand."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._yielded.clear()
        for collection in self.collections:
            collection.stop_prefetch()


_END = object()
