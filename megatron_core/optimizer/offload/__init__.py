"""Where optimizer states and masters live: device, host, or NVMe files streamed in chunks that overlap the
update (``NvmeAdam``); the host Adam kernels (``host_adam``)."""
from megatron_core.optimizer.offload.host_adam import AdamHyper, adamw_, fused_adamw_
from megatron_core.optimizer.offload.nvme_adam import NvmeAdam
from megatron_core.optimizer.offload.state_files import StateFiles, check_offload_dir

__all__ = ["AdamHyper", "NvmeAdam", "StateFiles", "adamw_", "check_offload_dir", "fused_adamw_"]
