"""Block I/O for L2: the io_uring backend (native ``_uring``) and its thread
fallback, and the fault injection the tests use."""
