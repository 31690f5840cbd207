"""Triton fused kernels (softmax, layernorm/RMSNorm, cross-entropy) with plain-torch references.

Each op lives in its own module with its kernels, reference, autograd function and dispatch. Importing this
package never imports Triton eagerly, so it works on machines without a GPU or a Triton compiler.
"""
