"""The torch kernels: the reference every other backend is tested against, and what runs
where neither the C nor the Triton kernels can."""
