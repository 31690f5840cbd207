"""Hands each data-parallel rank its micro-batches, resumable from ``consumed_samples``."""
from typing import Iterator, List


class MegatronPretrainingSampler:
    """Megatron-LM's sequential pretraining sampler.

    Samples ``consumed_samples, consumed_samples + 1, ...`` are cut into global chunks of
    ``micro_batch_size * data_parallel_size``; rank ``r`` takes slice ``[r * mbs, (r + 1) * mbs)`` of each
    chunk. Restarting with the ``consumed_samples`` saved in a checkpoint continues the same stream.

    Args:
        total_samples: length of the dataset.
        consumed_samples: samples already consumed by all ranks together (resume point).
        micro_batch_size: samples per micro-batch per rank.
        data_parallel_rank: this rank's index on the dp axis.
        data_parallel_size: ranks on the dp axis.
        drop_last: drop a final chunk smaller than ``micro_batch_size * data_parallel_size``.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples ({consumed_samples}) must be in [0, total_samples={total_samples}); "
                             "the run has used up its dataset: build it with more samples")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank ({data_parallel_rank}) must be in [0, data_parallel_size="
                             f"{data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _rank_slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start: start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                yield self._rank_slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._rank_slice(batch)
