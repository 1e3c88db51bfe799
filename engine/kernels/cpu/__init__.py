"""C kernels for CPUs (each *.c beside the Python launcher that builds and calls it) and
the "cpu" kernel backend that runs them."""
