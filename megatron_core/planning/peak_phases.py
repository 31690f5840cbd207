"""What coexists with the held activations at the moment a rank's memory peaks.

The held activations ``A`` (``activations.stage_activation_bytes``: what autograd saves, at the start of the
stage's backward) and each of the transients (``zero_memory``: gathered ZeRO-3 units, grad buckets, autograd's
grad of one parameter) peak at different moments of a step; adding each at its own peak over-predicts (ZeRO-3
at a 128k vocab: 0.838 measured / predicted). The peak is the largest of these moments (measured on a dry
run's timeline of live fake-CUDA bytes, Llama-3-8B shape, tp 1, s 8192, 128k vocab; bytes beyond ``A``):

- **the loss** (last stage): the logits' gradient is written beside the logits the cross-entropy saved (and
  ``_mask_padded_vocab``'s copy, and its slice's backward, hold two logits alike): ``+ L``, the logits shard
  ``e s b V/tp``. No parameter is gathered then: ZeRO-3 frees the output layer after its forward.
- **the output layer's backward** (last stage): the logits are freed, their gradient ``L`` in their place; the
  weight's gradient in the parameter dtype, the input's gradient ``e s b h`` and, at stage 3, the gathered
  weight (``e W``): ``+ 2 e W + e s b h`` at stage 3 (the measured peak at ZeRO-3), ``+ e W + e s b h`` below.
- **the output layer's gradient reduction** (stages 2-3, last stage): the logits' gradient freed (``- L``); the
  weight's gradient, its full-size fp32 bucket ``4 W`` (the weight alone: it opens the reverse-order buckets)
  and, at stage 3, the gathered weight.
- **a transformer layer's backward**: ``A`` less the logits (last stage) plus ``zero_memory``'s transients
  over the layers' units (two gathered units and a bucket at stage 3, the stage-2 buckets) and the MLP's
  backward (``mlp_workspace_bytes``), whose tensors replace saved ones as it goes. With ``X`` one ``[tokens,
  ffn/tp]`` tensor (an MoE layer: ``[M, ffn/etp]``, its M assignments): fc2's backward holds its input's grad
  ``X`` and its weight's grad beside everything saved (``X + fc2 grad``); fc2's saved input is freed then, so
  SwiGLU's multiply backward, which writes the gate's and the up projection's grads while that grad lives,
  is ``A + 2 X``, and every later step less (each frees a saved tensor of its own size); GELU's backward
  ``A + X``. fc1's backward comes after fc2's input, the activation's output and fc1's output (``2 g X``, ``g``
  2 for a gated activation else 1) were freed, beside the grad of fc1's output (``g X``): it holds fc1's weight
  grad (``g`` x fc2's), its input's grad ``H`` (``[tokens, h]``, the whole sequence before SP's
  reduce-scatter) and, under SP, its input gathered again for the weight grad (another ``H``): ``A - g X + g
  fc2 grad + H (1 + SP)``. So the moment is ``A`` plus the ZeRO transients plus the largest of the largest
  parameter grad, ``X + fc2 grad``, ``2 X`` (gated) and fc1's. Measured on the quickstart's first stage (GELU,
  fp32, tp 2: ``X`` 0.5 MiB, fc2's grad 0.125 MiB): its peak is fc2's input-grad GEMM of the first layer in
  backward, 0.625 MiB above the activations before it, as counted; on the 70B full-recompute dry run (SwiGLU,
  tp 8, SP) fc1's backward: the concatenated grad, fc1's weight grad, its input's grad and the re-gathered
  input (112, 112, 128, 128 MiB).
- **the embedding's backward** (first stage): that micro-batch's activations freed (``- P``, one micro-batch of
  one model chunk); the table's dense gradient in the parameter dtype, its fp32 bucket (stages 2-3) and, at
  stage 3, the gathered table.
- **the activations' own peak**: nothing beyond ``A`` (so the result is never negative).

(A dry run on a CPU build used to run ``silu_backward`` as its composite, whose ``[s, ffn/tp]`` temporaries a
GPU's fused kernel never allocates: ``dryrun.modes.register_cuda_silu_backward``.)
"""
from __future__ import annotations

import dataclasses

from megatron_core.config import TransformerConfig
from megatron_core.planning.layer_cost import element_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageMoments:
    """What the moments of one pipeline stage depend on (bytes, or elements where said)."""

    zero_stage: int
    first: bool
    last: bool
    tokens: float
    """Tokens of one micro-batch on the rank, ``s / cp x b`` (the output layer sees them all, SP or not)."""
    vocab_shard: float
    """Padded vocab entries on one tp rank: the output layer and embedding are ``vocab_shard x h`` elements."""
    layer_transient: float
    """``zero_memory.zero_transient_bytes(layers_only=True)``: a transformer layer's backward."""
    microbatch_bytes: float
    """One micro-batch's held activations of the model chunk holding the embedding."""
    mlp: "MlpBackward" = None
    """The stage's largest MLP backward (``mlp_backward``); None: no layers."""
    param_grad: float = 0.0
    """Autograd's grad of the largest parameter (part of ``layer_transient``)."""
    grad_bytes: int = 4
    """Per element of a gradient bucket (``Workload.grad_bytes``)."""


def loss_bytes(config: TransformerConfig, moments: StageMoments) -> float:
    """The loss's moment: a second logits-sized tensor beside the saved logits."""
    return element_bytes(config) * moments.tokens * moments.vocab_shard if moments.last else 0.0


def output_layer_bytes(config: TransformerConfig, moments: StageMoments) -> float:
    """The largest of the output layer's backward and its grad reduction (last stage)."""
    if not moments.last:
        return 0.0
    e, weight = element_bytes(config), moments.vocab_shard * config.hidden_size
    gathered = e * weight if moments.zero_stage == 3 else 0.0
    backward = gathered + e * weight + e * moments.tokens * config.hidden_size
    if moments.zero_stage < 2:
        return backward
    return max(backward, gathered + e * weight + moments.grad_bytes * weight - loss_bytes(config, moments))


def embedding_bytes(config: TransformerConfig, moments: StageMoments) -> float:
    """The embedding's backward (first stage), its micro-batch's activations freed."""
    if not moments.first:
        return 0.0
    e, table = element_bytes(config), moments.vocab_shard * config.hidden_size
    grad = moments.grad_bytes * table if moments.zero_stage >= 2 else 0.0
    held = e * table + grad + (e * table if moments.zero_stage == 3 else 0.0)
    return held - moments.microbatch_bytes


@dataclasses.dataclass(frozen=True)
class MlpBackward:
    """Bytes of one MLP backward's tensors: ``x`` one ``[tokens, ffn/tp]``, ``fc2_grad`` fc2's weight grad
    ``[h, ffn/tp]`` (the parameter dtype), ``hidden`` fc1's input grad ``[tokens, h]``; ``regathered``: SP
    gathers fc1's input again for its weight grad."""
    x: float
    fc2_grad: float
    hidden: float
    regathered: bool


def mlp_backward(config: TransformerConfig, *, tokens: float, tp: int, etp: int, moe_tokens: float, dense: bool,
                 moe: bool) -> MlpBackward:
    """The dense MLP's backward (``dense``: ``tokens`` of the whole sequence) or an MoE layer's experts' (``moe``:
    ``moe_tokens`` M assignments on the rank, ``[M, ffn/etp]``), whichever has the larger ``x``."""
    e, h, shapes = element_bytes(config), config.hidden_size, []
    if dense:
        shapes.append((tokens, config.ffn_hidden_size / tp, bool(config.sequence_parallel and tp > 1)))
    if moe:
        shapes.append((moe_tokens, (config.moe.moe_ffn_hidden_size or config.ffn_hidden_size) / etp, False))
    rows, ffn, regathered = max(shapes, key=lambda shape: shape[0] * shape[1])
    return MlpBackward(e * rows * ffn, e * h * ffn, e * rows * h, regathered)


def mlp_workspace_bytes(config: TransformerConfig, moments: StageMoments) -> float:
    """The MLP backward's bytes at the layer's moment beyond ``layer_transient`` (which holds the largest
    parameter's grad ``param_grad``): the largest of fc2's, the gated multiply's and fc1's moments less that
    grad, at least 0 (the module docstring)."""
    mlp, g = moments.mlp, 2 if config.gated_activation else 1
    fc1 = -g * mlp.x + g * mlp.fc2_grad + mlp.hidden * (2 if mlp.regathered else 1)
    largest = max(mlp.x + mlp.fc2_grad, 2 * mlp.x if g == 2 else 0.0, fc1)
    return max(0.0, largest - moments.param_grad)


def peak_extra_bytes(config: TransformerConfig, moments: StageMoments) -> float:
    """Bytes beyond the held activations at the stage's peak moment (the module docstring's moments)."""
    layer = moments.layer_transient - loss_bytes(config, moments)  # the logits are gone by then
    if moments.layer_transient and moments.mlp is not None:
        layer += mlp_workspace_bytes(config, moments)
    return max(0.0, loss_bytes(config, moments), output_layer_bytes(config, moments), layer,
               embedding_bytes(config, moments))


__all__ = ["StageMoments", "MlpBackward", "loss_bytes", "output_layer_bytes", "embedding_bytes", "mlp_backward",
           "mlp_workspace_bytes", "peak_extra_bytes"]
