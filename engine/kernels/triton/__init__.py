"""Triton kernels for GPUs and the "triton" kernel backend that runs them. Importing
this package does not import Triton; its modules do."""
