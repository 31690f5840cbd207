"""megatron_core: Megatron-style tensor, pipeline and data (ZeRO) parallel training of GPT models.

Importing this package needs neither a GPU nor a working Triton compiler.
"""
from megatron_core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel

__version__ = "0.1.0"
__all__ = ["ParallelState", "initialize_model_parallel", "destroy_model_parallel", "__version__"]
