"""The model runner and what sizes and places it: device memory budget, CUDA graphs,
CPU allocator tuning, device checks."""
