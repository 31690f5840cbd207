"""The training data loader ``initialize(training_data=...)`` returns: DeepSpeed's ``DeepSpeedDataLoader``.

Each dp rank reads its ``1/dp`` of the dataset through a ``DistributedSampler`` (shuffled with seed 0, the
same order every epoch unless ``data_sampler.set_epoch`` is called, as DeepSpeed does) in batches of
``train_micro_batch_size_per_gpu``. DeepSpeed starts ``2 * devices`` loader workers; this loader reads in
the training process (the batches are the same).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class EngineDataLoader:
    """Iterates micro-batches of ``dataset`` for dp rank ``dp_rank`` of ``dp_size``.

    Args:
        dataset: a map-style ``torch.utils.data.Dataset``.
        batch_size: samples per micro-batch (``train_micro_batch_size_per_gpu``).
        dp_rank, dp_size: this rank's position in the data-parallel group.
        collate_fn: as ``DataLoader``'s (``initialize(collate_fn=...)``).
        drop_last: ``dataloader_drop_last``.
        pin_memory: pin the batches (CUDA).
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int, dp_size: int,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False, pin_memory: bool = False) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(f"training_data must be a map-style dataset (with __len__ and __getitem__), got "
                             f"{type(dataset).__name__}; iterate your own loader instead")
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.drop_last, self.pin_memory = drop_last, pin_memory
        self.data_sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank)
        self.len = len(self.data_sampler) // batch_size if drop_last else -(-len(self.data_sampler) // batch_size)
        self._data: Optional[Iterator] = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> "EngineDataLoader":
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.data_sampler,
                            collate_fn=self.collate_fn, drop_last=self.drop_last, pin_memory=self.pin_memory)
        self._data = iter(loader)
        return self

    def __next__(self) -> Any:
        if self._data is None:
            iter(self)
        return next(self._data)


class RepeatingLoader:
    """Restarts ``loader`` when it is exhausted (DeepSpeed's ``RepeatingLoader``)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


__all__ = ["EngineDataLoader", "RepeatingLoader"]
