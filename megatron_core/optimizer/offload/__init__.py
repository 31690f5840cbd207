"""Where optimizer states and masters live: device, host, or NVMe files streamed in chunks that overlap the
update (``NvmeAdam``); ZeRO-3 parameter shards on the host or NVMe (``offload_parameters``); the host
Adam kernels (``host_adam``)."""
from megatron_core.optimizer.offload.host_adam import AdamHyper, adamw_, fused_adamw_
from megatron_core.optimizer.offload.nvme_adam import NvmeAdam
from megatron_core.optimizer.offload.param_offload import PARAM_OFFLOAD, offload_parameters
from megatron_core.optimizer.offload.state_files import StateFiles, check_offload_dir

__all__ = ["AdamHyper", "NvmeAdam", "PARAM_OFFLOAD", "StateFiles", "adamw_", "check_offload_dir", "fused_adamw_",
           "offload_parameters"]
